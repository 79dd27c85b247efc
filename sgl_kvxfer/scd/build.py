"""Turn paired traces into artifact tensors: Reuse moments -> fits -> named tensors.

`ReuseMoments` accumulates, per layer and kv head, the joint moments of the producer's and every
consumer's de-rotated keys (and values) for the same tokens. `fit_reuse` fits ranks (r_k, r_v)
from them (refitting another rank costs only the closed form: the rank sweep of the quality
harness uses that). `patch_tensors` names a fitted H encoder and the trained aligners.
"""
from __future__ import annotations

import torch

from sgl_kvxfer.scd.fit import JointMoments, fit_joint


class ReuseMoments:
    """Per layer: K and V JointMoments over H groups (kv heads) of width D, 1 + N blocks."""

    def __init__(self, num_layers: int, num_heads: int, head_dim: int, num_consumers: int, device="cpu"):
        self.num_heads, self.head_dim = num_heads, head_dim
        self.k = [JointMoments(num_heads, head_dim, 1 + num_consumers, device) for _ in range(num_layers)]
        self.v = [JointMoments(num_heads, head_dim, 1 + num_consumers, device) for _ in range(num_layers)]

    def update(self, layer: int, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> None:
        """ks, vs: [producer, consumer_1, ...], each [n, H, D] (keys de-rotated) for the same n tokens."""
        self.k[layer].update(torch.cat(ks, -1).transpose(0, 1))  # [H, n, (1+N) D]
        self.v[layer].update(torch.cat(vs, -1).transpose(0, 1))

    def state(self) -> dict[str, torch.Tensor]:
        out = {}
        for i, (k, v) in enumerate(zip(self.k, self.v)):
            out.update(k.state(f"k.{i}"))
            out.update(v.state(f"v.{i}"))
        return out

    @classmethod
    def from_state(cls, state: dict) -> "ReuseMoments":
        layers = sorted({int(key.split(".")[1]) for key in state if key.startswith("k.")})
        obj = cls.__new__(cls)
        obj.k = [JointMoments.from_state(state, f"k.{i}") for i in layers]
        obj.v = [JointMoments.from_state(state, f"v.{i}") for i in layers]
        obj.num_heads, obj.head_dim = obj.k[0].s1.shape[0], obj.k[0].width
        return obj


def fit_reuse(moments: ReuseMoments, layers, r_k: int, r_v: int, consumers: list[str],
              ridge: float = 1e-4) -> tuple[dict[str, torch.Tensor], dict]:
    """Artifact tensors (producer k/v enc + mu; per consumer k/v dec + mu) for `layers`, and a
    report {consumer: {"k_rel_err": [per layer], "v_rel_err": [...]}} on the fit data."""
    tensors: dict[str, torch.Tensor] = {}
    report = {c: {"layers": list(layers), "k_rel_err": [], "v_rel_err": []} for c in consumers}
    for layer in layers:
        for kind, rank, jm in (("k", r_k, moments.k[layer]), ("v", r_v, moments.v[layer])):
            fit = fit_joint(jm, rank, ridge)
            tensors[f"producer/{kind}_enc.{layer}"] = fit.enc  # [H, D, r]
            tensors[f"producer/{kind}_mu.{layer}"] = fit.mu_a  # [H, D]
            for i, c in enumerate(consumers):
                tensors[f"{c}/{kind}_dec.{layer}"] = fit.dec[i]  # [H, r, D]
                tensors[f"{c}/{kind}_mu.{layer}"] = fit.mu_b[i]
                report[c][f"{kind}_rel_err"].append(round(float(fit.rel_err[i].mean()), 6))
    return tensors, report


def patch_tensors(layer: int, h_fit, aligners: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """h_fit: a JointFit with G = 1 (the layer's hidden states); aligners: consumer -> params."""
    out = {f"producer/h_enc.{layer}": h_fit.enc[0], f"producer/h_mu.{layer}": h_fit.mu_a[0]}
    for c, params in aligners.items():
        for name, t in params.items():
            out[f"{c}/a_{name}.{layer}"] = t.detach().float().cpu()
    return out
