"""Turn paired traces into artifact tensors: Reuse moments -> fits -> named tensors.

`ReuseMoments` accumulates, per layer and kv head, the joint moments of the producer's and every
consumer's de-rotated keys (and values) for the same tokens. `fit_reuse` fits ranks (r_k, r_v)
from them (refitting another rank costs only the closed form: the rank sweep of the quality
harness uses that). `patch_tensors` names a fitted H encoder and the trained aligners.
"""
from __future__ import annotations

import torch

from sgl_kvxfer.scd.calib.fit import JointMoments, fit_joint


class ReuseMoments:
    """Per layer: K and V JointMoments, 1 + N blocks; head_mode "joint": one group of width H*D
    (the layer's heads flattened, head-major), "per_head": H groups of width D."""

    def __init__(self, num_layers: int, num_heads: int, head_dim: int, num_consumers: int, device="cpu",
                 head_mode: str = "joint"):
        self.num_heads, self.head_dim, self.head_mode = num_heads, head_dim, head_mode
        groups, width = (1, num_heads * head_dim) if head_mode == "joint" else (num_heads, head_dim)
        self.k = [JointMoments(groups, width, 1 + num_consumers, device) for _ in range(num_layers)]
        self.v = [JointMoments(groups, width, 1 + num_consumers, device) for _ in range(num_layers)]

    def _rows(self, xs: list[torch.Tensor]) -> torch.Tensor:
        if self.head_mode == "joint":
            return torch.cat([x.reshape(x.shape[0], -1) for x in xs], -1)[None]  # [1, n, (1+N) H D]
        return torch.cat(xs, -1).transpose(0, 1)  # [H, n, (1+N) D]

    def update(self, layer: int, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> None:
        """ks, vs: [producer, consumer_1, ...], each [n, H, D] (keys de-rotated) for the same n tokens."""
        self.k[layer].update(self._rows(ks))
        self.v[layer].update(self._rows(vs))

    def state(self) -> dict[str, torch.Tensor]:
        out = {}
        for i, (k, v) in enumerate(zip(self.k, self.v)):
            out.update(k.state(f"k.{i}"))
            out.update(v.state(f"v.{i}"))
        return out

    @classmethod
    def from_state(cls, state: dict, num_heads: int, head_mode: str) -> "ReuseMoments":
        layers = sorted({int(key.split(".")[1]) for key in state if key.startswith("k.")})
        obj = cls.__new__(cls)
        obj.k = [JointMoments.from_state(state, f"k.{i}") for i in layers]
        obj.v = [JointMoments.from_state(state, f"v.{i}") for i in layers]
        obj.num_heads, obj.head_mode = num_heads, head_mode
        obj.head_dim = obj.k[0].width // (num_heads if head_mode == "joint" else 1)
        return obj


def fit_reuse(moments: ReuseMoments, layers, r_k: int, r_v: int, consumers: list[str],
              ridge: float = 1e-4, levels=(), unit_codes: bool = False) -> tuple[dict[str, torch.Tensor], dict]:
    """Artifact tensors (producer k/v enc + mu; per consumer k/v dec + mu) for `layers`, and a
    report {consumer: {"k_rel_err": [per layer], "v_rel_err": [...]}} on the fit data.
    levels: lower (r_k', r_v') pairs of nested codes: each consumer also gets `k_dec@r_k'.l` /
    `v_dec@r_v'.l`, the decoders of the first r' code columns (the producer's encoder is shared).
    unit_codes: every code column at unit variance (fit.py; the manifest's code_scale "unit")."""
    tensors: dict[str, torch.Tensor] = {}
    report = {c: {"layers": list(layers), "k_rel_err": [], "v_rel_err": []} for c in consumers}
    h, d = moments.num_heads, moments.head_dim
    joint = moments.head_mode == "joint"
    nested = {"k": sorted({a for a, _ in levels if a < r_k}), "v": sorted({b for _, b in levels if b < r_v})}
    for layer in layers:
        for kind, rank, jm in (("k", r_k, moments.k[layer]), ("v", r_v, moments.v[layer])):
            scale = h if joint else 1
            fit = fit_joint(jm, scale * rank, ridge, [scale * r for r in nested[kind]], unit_codes=unit_codes)
            # joint: enc [H*D, H*r], dec [H*r, H*D]; per_head: enc [H, D, r], dec [H, r, D]; mu [H, D]
            tensors[f"producer/{kind}_enc.{layer}"] = fit.enc[0] if joint else fit.enc
            tensors[f"producer/{kind}_mu.{layer}"] = fit.mu_a.reshape(h, d)
            for i, c in enumerate(consumers):
                tensors[f"{c}/{kind}_dec.{layer}"] = fit.dec[i][0] if joint else fit.dec[i]
                tensors[f"{c}/{kind}_mu.{layer}"] = fit.mu_b[i].reshape(h, d)
                report[c][f"{kind}_rel_err"].append(round(float(fit.rel_err[i].mean()), 6))
                for r in nested[kind]:
                    dec = fit.dec_at[scale * r][i]
                    tensors[f"{c}/{kind}_dec@{r}.{layer}"] = dec[0] if joint else dec
                    report[c].setdefault(f"{kind}_rel_err@{r}", []).append(
                        round(float(fit.rel_err_at[scale * r][i].mean()), 6))
    return tensors, report


def patch_tensors(layer: int, h_fit, aligners: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """h_fit: a JointFit with G = 1 (the layer's hidden states); aligners: consumer -> params."""
    out = {f"producer/h_enc.{layer}": h_fit.enc[0], f"producer/h_mu.{layer}": h_fit.mu_a[0]}
    for c, params in aligners.items():
        for name, t in params.items():
            out[f"{c}/a_{name}.{layer}"] = t.detach().float().cpu()
    return out
