"""A consumer's rebuild of one code segment with a fixed, small number of launches.

`ScdDecoder.decode_reuse` / `regenerate_patch` (codec.py) work one layer at a time: a 32-layer
model costs some 15 launches per layer per segment, whatever the segment's length, and each
Patch layer re-casts its bf16 W_k / W_v to float32 on every call. `StackedRebuild` does the same
arithmetic over all Reuse layers at once and all Patch layers at once:

    Reuse:  zk [Lr, T, H, r_k] --bmm k_dec [Lr, H*r_k, H*D]--> + k_mu --> RoPE --> k [Lr, T, H, D]
            zv [Lr, T, H, r_v] --bmm v_dec [Lr, H*r_v, H*D]--> + v_mu -------------> v [Lr, T, H, D]
    Patch:  zh [Lp, T, r_h] --aligners (baddbmm)--> h_hat [Lp, T, hidden]
            h_hat --bmm W_k^T, W_v^T [Lp, hidden, H*D] (+ b)--> RoPE(k), v

("per_head" artifacts: the decoders are [Lr, H, r, D], one matmul batched over layers and heads.)
The stacked decoders (one per rank level), the stacked aligners and the Patch
layers' float32 W_k / W_v live on the device from construction: nothing is re-materialised per
segment. Every layer's arithmetic is the per-layer path's, in float32; the two may differ only
where a batched GEMM rounds differently from an unbatched one (the tests bound it).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from sgl_kvxfer.scd.codec import ALIGNER_PARAMS, KVProjection, ScdDecoder

Codes = dict[tuple[int, str], torch.Tensor]
LayerGroup = tuple[tuple[int, ...], torch.Tensor, torch.Tensor]  # (layer ids, k, v [L', T, H, D])


class StackedRebuild:
    def __init__(self, decoder: ScdDecoder, projections: list[KVProjection], device):
        m = self.manifest = decoder.manifest
        self.decoder, self.rotary = decoder, decoder.rotary
        self.reuse, self.patch = tuple(m.reuse_layers), tuple(m.patch_layers)
        self.joint = m.head_mode == "joint"
        self.device = torch.device(device)
        self._dec: dict[tuple[str, int], torch.Tensor] = {}  # (kind, rank) -> stacked decoder
        if self.reuse:
            # mu [H, D] per layer -> [Lr, 1, H, D] (broadcast over tokens)
            self.k_mu = torch.stack([decoder.k_mu[l] for l in self.reuse]).unsqueeze(1).to(self.device)
            self.v_mu = torch.stack([decoder.v_mu[l] for l in self.reuse]).unsqueeze(1).to(self.device)
            for r_k, r_v in m.levels:  # every level's stacked decoders now, not in a request
                self._decoders("k", r_k), self._decoders("v", r_v)
        if self.patch:
            # aligner params: matrices [Lp, a, b], vectors [Lp, 1, n] (broadcast over tokens)
            self.aligner = {}
            for name in ALIGNER_PARAMS:
                t = torch.stack([decoder.aligners[l][name] for l in self.patch]).to(self.device)
                self.aligner[name] = t.unsqueeze(1) if t.dim() == 2 else t
            self.has_mlp = self.aligner["w1"].shape[-1] > 0
            # W^T [Lp, hidden, H*D] float32, contiguous (F.linear's h @ W^T, no per-call transpose copy).
            # NOTE: copies of the model's weights at construction (the engine never updates weights
            # in place; a server that did would have to rebuild this object)
            projs = [projections[l] for l in self.patch]
            self.w_k_t = torch.stack([p.w_k.float().t() for p in projs]).contiguous().to(self.device)
            self.w_v_t = torch.stack([p.w_v.float().t() for p in projs]).contiguous().to(self.device)
            self.b_k = None if projs[0].b_k is None else torch.stack([p.b_k.float() for p in projs]).unsqueeze(1).to(self.device)
            self.b_v = None if projs[0].b_v is None else torch.stack([p.b_v.float() for p in projs]).unsqueeze(1).to(self.device)

    def _decoders(self, kind: str, rank: int) -> torch.Tensor:
        """The Reuse layers' `kind` decoders at `rank`, stacked: joint [Lr, H*r, H*D], per_head
        [Lr, H, r, D], on the device (built at construction for every level of the manifest)."""
        key = (kind, rank)
        if key not in self._dec:
            table = self.decoder.k_dec if kind == "k" else self.decoder.v_dec
            if any((l, rank) not in table for l in self.reuse):
                raise ValueError(f"codes of rank {rank} match no level of {self.manifest.levels}")
            self._dec[key] = torch.stack([table[(l, rank)] for l in self.reuse]).to(self.device)
        return self._dec[key]

    def _project(self, z: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """z [L, T, H, a] float32 -> [L, T, H, D] through stacked decoders w."""
        L, T, H, _ = z.shape
        if self.joint:
            return torch.matmul(z.reshape(L, T, -1), w).view(L, T, H, -1)
        return torch.matmul(z.transpose(1, 2), w).transpose(1, 2)  # [L, H, T, a] @ [L, H, a, D]

    def reuse_kv(self, codes: Codes, positions: torch.Tensor, out_dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every Reuse layer's (k post-RoPE, v) [Lr, T, H, D] in `out_dtype`; the rank level is
        read from the codes' width (all layers of a segment share it)."""
        zk = torch.stack([codes[(l, "k")] for l in self.reuse]).float()
        zv = torch.stack([codes[(l, "v")] for l in self.reuse]).float()
        kc = self._project(zk, self._decoders("k", zk.shape[-1])) + self.k_mu
        v = self._project(zv, self._decoders("v", zv.shape[-1])) + self.v_mu
        return self.rotary.rope(kc, positions, out_dtype), v.to(out_dtype)

    def patch_kv(self, codes: Codes, positions: torch.Tensor, out_dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every Patch layer's (k post-RoPE, v) [Lp, T, H, D] in `out_dtype`: aligners, then this
        model's own W_k / W_v."""
        p = self.aligner
        u = torch.stack([codes[(l, "h")] for l in self.patch]).float() / p["scale"]
        h = torch.baddbmm(p["lin_b"], u, p["lin_w"])
        if self.has_mlp:
            h = h + torch.baddbmm(p["b2"], F.gelu(torch.baddbmm(p["b1"], u, p["w1"])), p["w2"])
        L, T = h.shape[:2]
        d = self.manifest.head_dim
        k, v = torch.bmm(h, self.w_k_t), torch.bmm(h, self.w_v_t)
        if self.b_k is not None:
            k, v = k + self.b_k, v + self.b_v
        return self.rotary.rope(k.view(L, T, -1, d), positions, out_dtype), v.view(L, T, -1, d).to(out_dtype)

    def rebuild(self, codes: Codes, positions: torch.Tensor, out_dtype: torch.dtype,
                mark=lambda name: None) -> list[LayerGroup]:
        """The segment's K/V as layer groups (layer ids, k post-RoPE, v [L', T, H, D] in
        `out_dtype`): the Reuse layers, then the Patch layers (`KVPool.write_layers` stores a
        group at once). `positions` [T] must be primed (`rotary.prime`): every RoPE of the
        segment reuses its cos / sin. `mark`: part boundaries ("reuse", "patch") for the trace."""
        groups = []
        if self.reuse:
            groups.append((self.reuse, *self.reuse_kv(codes, positions, out_dtype)))
        mark("reuse")
        if self.patch:
            groups.append((self.patch, *self.patch_kv(codes, positions, out_dtype)))
        mark("patch")
        return groups


def per_layer(groups: list[LayerGroup], num_layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Layer groups -> per-layer (k, v) [T, H, D] views, in layer order."""
    out: list = [None] * num_layers
    for layers, k, v in groups:
        for i, layer in enumerate(layers):
            out[layer] = (k[i], v[i])
    return out
