"""SCD codecs: the producer's encoder and one consumer's decoder (pure torch, any device).

Producer, per layer (one encoding serves every consumer of the artifacts):
    reuse l:  zk = (deRoPE(k) - mu_k) @ k_enc      zv = (v - mu_v) @ v_enc      (head_mode "joint":
              over the layer's heads flattened, [T, H*D] @ [H*D, H*r]; "per_head": per kv head)
    patch l:  zh = (h_norm - mu_h) @ h_enc         h_norm = input_layernorm output of layer l
Consumer c:
    reuse l:  k = RoPE(zk @ k_dec_c + mu_k_c)      v = zv @ v_dec_c + mu_v_c
    patch l:  h_hat = g_c(zh)  (MLP aligner), then k = RoPE(h_hat W_k_c^T), v = h_hat W_v_c^T
              with the consumer's OWN projections (`regenerate_kv`, `kv_projections`).

Nested ranks: `encode_reuse(..., level=(r_k', r_v'))` sends the first columns of the top code;
`decode_reuse` reads the level from the codes' width and uses that level's decoder.

Shapes are token-major like the engine's KV pool: k, v [T, H, D]; positions LongTensor [T] (the
absolute position of each token, as the engine rotated it). Codes are cast to the manifest's
wire dtype; with a quantised one ("int8" / "int4", mem_cache/scd_quant.py) the encoder returns float32 codes
already on the wire grid (per token and field: one scale), so the offline harness measures what
the wire delivers and packing them is lossless. All arithmetic runs in float32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sgl_kvxfer.scd.artifacts import ScdArtifacts
from sgl_kvxfer.mem_cache.scd_quant import fake_quant
from sgl_kvxfer.scd.rotary import KeyRotary


def _rotary(manifest) -> KeyRotary:
    m = manifest
    return KeyRotary(m.head_dim, m.rope_theta, m.rope_scaling, m.max_position_embeddings)


def _on(t: torch.Tensor, device) -> torch.Tensor:
    return t if device is None else t.to(device)


class ScdEncoder:
    """Producer side. `device`: where the encoder matrices live (default: where loaded)."""

    def __init__(self, artifacts: ScdArtifacts, device: str | torch.device | None = None):
        self.manifest = m = artifacts.manifest
        self.rotary = _rotary(m)
        get = artifacts.producer_tensor
        self.k_enc, self.k_mu, self.v_enc, self.v_mu, self.h_enc, self.h_mu = {}, {}, {}, {}, {}, {}
        for layer in m.reuse_layers:
            self.k_enc[layer], self.k_mu[layer] = _on(get(f"k_enc.{layer}"), device), _on(get(f"k_mu.{layer}"), device)
            self.v_enc[layer], self.v_mu[layer] = _on(get(f"v_enc.{layer}"), device), _on(get(f"v_mu.{layer}"), device)
        for layer in m.patch_layers:
            self.h_enc[layer], self.h_mu[layer] = _on(get(f"h_enc.{layer}"), device), _on(get(f"h_mu.{layer}"), device)

    def encode_reuse(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     level: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """k post-RoPE [T, H, D], v [T, H, D], positions [T] -> zk [T, H, r_k], zv [T, H, r_v] at
        `level` (one of manifest.levels; default the top)."""
        if layer not in self.k_enc:
            raise ValueError(f"layer {layer} is a {self.manifest.layer_kind(layer)} layer, not reuse")
        r_k, r_v = level or (self.manifest.r_k, self.manifest.r_v)
        if (r_k, r_v) not in self.manifest.levels:
            raise ValueError(f"rank level {(r_k, r_v)} is not one of the artifacts' {self.manifest.levels}")
        kc = self.rotary.derope(k, positions) - self.k_mu[layer]
        zk = _project(kc, _prefix(self.k_enc[layer], r_k, self.manifest.num_kv_heads), r_k)
        zv = _project(v.float() - self.v_mu[layer], _prefix(self.v_enc[layer], r_v, self.manifest.num_kv_heads), r_v)
        return self._wire(zk), self._wire(zv)

    def _wire(self, z: torch.Tensor) -> torch.Tensor:
        """Codes [T, ...] as the wire carries them (one token's field per row)."""
        bits = self.manifest.wire_bits
        return fake_quant(z, bits) if bits else z.to(self.manifest.code_dtype)

    def encode_patch(self, layer: int, h_norm: torch.Tensor) -> torch.Tensor:
        """h_norm [T, hidden] (the producer's input_layernorm output at `layer`) -> zh [T, r_h]."""
        if layer not in self.h_enc:
            raise ValueError(f"layer {layer} is a {self.manifest.layer_kind(layer)} layer, not patch")
        return self._wire((h_norm.float() - self.h_mu[layer]) @ self.h_enc[layer])


class ScdDecoder:
    """One consumer's side. `consumer`: its name in the manifest (`ScdArtifacts.check_pair`
    returns it for a model)."""

    def __init__(self, artifacts: ScdArtifacts, consumer: str, device: str | torch.device | None = None):
        self.manifest = m = artifacts.manifest
        self.consumer = consumer
        self.rotary = _rotary(m)

        def get(name):
            return _on(artifacts.consumer_tensor(consumer, name), device)

        self.k_dec, self.k_mu, self.v_dec, self.v_mu, self.aligners = {}, {}, {}, {}, {}
        lower_k = sorted({a for a, _ in m.rank_levels if a < m.r_k})
        lower_v = sorted({b for _, b in m.rank_levels if b < m.r_v})
        for layer in m.reuse_layers:  # decoders keyed (layer, rank)
            self.k_dec[(layer, m.r_k)], self.k_mu[layer] = get(f"k_dec.{layer}"), get(f"k_mu.{layer}")
            self.v_dec[(layer, m.r_v)], self.v_mu[layer] = get(f"v_dec.{layer}"), get(f"v_mu.{layer}")
            for r in lower_k:
                self.k_dec[(layer, r)] = get(f"k_dec@{r}.{layer}")
            for r in lower_v:
                self.v_dec[(layer, r)] = get(f"v_dec@{r}.{layer}")
        for layer in m.patch_layers:
            self.aligners[layer] = {n: get(f"a_{n}.{layer}") for n in ALIGNER_PARAMS}

    def decode_reuse(self, layer: int, zk: torch.Tensor, zv: torch.Tensor, positions: torch.Tensor,
                     out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """zk [T, H, r_k], zv [T, H, r_v] at any level (read from their width), positions [T] ->
        (k post-RoPE [T, H, D], v [T, H, D])."""
        if layer not in self.k_mu:
            raise ValueError(f"layer {layer} is a {self.manifest.layer_kind(layer)} layer, not reuse")
        kd, vd = self.k_dec.get((layer, zk.shape[-1])), self.v_dec.get((layer, zv.shape[-1]))
        if kd is None or vd is None:
            raise ValueError(f"codes of ranks ({zk.shape[-1]}, {zv.shape[-1]}) match no level of {self.manifest.levels}")
        d = self.manifest.head_dim
        kc = _project(zk.float(), kd, d) + self.k_mu[layer]
        v = _project(zv.float(), vd, d) + self.v_mu[layer]
        return self.rotary.rope(kc, positions, out_dtype), v.to(out_dtype)

    def align_patch(self, layer: int, zh: torch.Tensor) -> torch.Tensor:
        """zh [T, r_h] -> h_hat [T, hidden] float32: the consumer's estimated input_layernorm output."""
        if layer not in self.aligners:
            raise ValueError(f"layer {layer} is a {self.manifest.layer_kind(layer)} layer, not patch")
        return apply_aligner(self.aligners[layer], zh.float())

    def regenerate_patch(self, layer: int, zh: torch.Tensor, positions: torch.Tensor, proj: "KVProjection",
                         out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """align_patch, then the consumer's own K/V projection of layer `layer` (+RoPE)."""
        return regenerate_kv(self.align_patch(layer, zh), proj, positions, self.rotary, out_dtype)


def _prefix(enc: torch.Tensor, r: int, heads: int) -> torch.Tensor:
    """The encoder of the rank-r prefix code: joint [H*D, H*r_top] -> [H*D, H*r]; per_head
    [H, D, r_top] -> [H, D, r]."""
    return enc[:, :heads * r] if enc.dim() == 2 else enc[..., :r]


def _project(x: torch.Tensor, w: torch.Tensor, out_per_head: int) -> torch.Tensor:
    """x [T, H, a] through a layer's map: joint w [H*a, H*b] (one matmul across heads) or per-head
    w [H, a, b] -> [T, H, b] (b = out_per_head)."""
    if w.dim() == 2:
        return (x.reshape(x.shape[0], -1) @ w).view(x.shape[0], x.shape[1], out_per_head)
    return torch.einsum("tha,hab->thb", x, w)


ALIGNER_PARAMS = ("scale", "lin_w", "lin_b", "w1", "b1", "w2", "b2")


def apply_aligner(p: dict[str, torch.Tensor], zh: torch.Tensor) -> torch.Tensor:
    """g(z) = u W_lin + b_lin + gelu(u W1 + b1) W2 + b2, u = z / scale. [T, r_h] -> [T, hidden]."""
    u = zh / p["scale"]
    out = torch.addmm(p["lin_b"], u, p["lin_w"])
    if p["w1"].shape[1]:
        out = out + torch.addmm(p["b2"], F.gelu(torch.addmm(p["b1"], u, p["w1"])), p["w2"])
    return out


@dataclass
class KVProjection:
    """A consumer layer's K/V projection: w_k, w_v [H*D, hidden] (nn.Linear layout), optional biases."""

    w_k: torch.Tensor
    w_v: torch.Tensor
    b_k: torch.Tensor | None = None
    b_v: torch.Tensor | None = None


def kv_projections(model) -> list[KVProjection]:
    """Per-layer K/V projections of our engine's LlamaForCausalLM (views into its fused qkv_proj)."""
    c = model.config
    q, kv = c.q_size, c.kv_size
    out = []
    for layer in model.model.layers:
        lin = layer.self_attn.qkv_proj
        b = lin.bias
        out.append(KVProjection(lin.weight[q:q + kv], lin.weight[q + kv:q + 2 * kv],
                                None if b is None else b[q:q + kv], None if b is None else b[q + kv:q + 2 * kv]))
    return out


def regenerate_kv(h_hat: torch.Tensor, proj: KVProjection, positions: torch.Tensor, rotary: KeyRotary,
                  out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """h_hat [T, hidden] -> (k post-RoPE [T, H, D], v [T, H, D]) with the consumer's weights, in
    float32 (the engine computes the same projection in its model dtype)."""
    t, d = h_hat.shape[0], rotary.rotary.head_dim
    h = h_hat.float()
    k = F.linear(h, proj.w_k.float(), None if proj.b_k is None else proj.b_k.float()).view(t, -1, d)
    v = F.linear(h, proj.w_v.float(), None if proj.b_v is None else proj.b_v.float()).view(t, -1, d)
    return rotary.rope(k, positions, out_dtype), v.to(out_dtype)
