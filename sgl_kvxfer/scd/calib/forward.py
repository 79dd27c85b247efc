"""A batched, tap-able forward over our engine's LlamaForCausalLM weights (offline SCD work).

Calibration and the quality harness need what the serving forward does not expose: per-layer
post-RoPE K/V and input_layernorm outputs, a prefix cache supplied from outside (reconstructed
by a codec), and runs of layers started from a given residual stream (DroidSpeak-style
recompute). This module runs the SAME modules as the engine (RMSNorm, qkv_proj, RoPE tables,
MLP), so the K/V it captures is what the engine's pool stores for the same tokens (tested).

Layout: rows are left-padded to a common length S. valid [B, S] marks real tokens; positions
[B, S] are each token's position in its own sequence. K/V are token-major per row:
[B, S, H, D]. A padded query attends to itself only, so padding never produces NaN.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from sgl_kvxfer.layers import fused_ops


@dataclass
class KVCache:
    """Per-layer prefix K/V [B, P, H, D] (post-RoPE) and which prefix slots are real [B, P]."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    valid: torch.Tensor

    @property
    def length(self) -> int:
        return self.valid.shape[1]

    def extended(self, k: list[torch.Tensor], v: list[torch.Tensor], valid: torch.Tensor) -> "KVCache":
        return KVCache([torch.cat([a, b], 1) for a, b in zip(self.k, k)],
                       [torch.cat([a, b], 1) for a, b in zip(self.v, v)], torch.cat([self.valid, valid], 1))


@dataclass
class Taps:
    k: dict[int, torch.Tensor] = field(default_factory=dict)  # [B, S, H, D] post-RoPE
    v: dict[int, torch.Tensor] = field(default_factory=dict)
    h: dict[int, torch.Tensor] = field(default_factory=dict)  # [B, S, hidden] input_layernorm output
    resid: dict[int, torch.Tensor] = field(default_factory=dict)  # [B, S, hidden] stream entering layer
    logits: torch.Tensor | None = None  # [B, S, V] float32


def left_pad(seqs: list[list[int]], pad_id: int = 0, device="cpu"):
    """Token lists -> (ids [B, S], valid [B, S], positions [B, S]) left-padded to the longest."""
    s = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), s), pad_id, dtype=torch.long)
    valid = torch.zeros(len(seqs), s, dtype=torch.bool)
    for i, x in enumerate(seqs):
        if x:
            ids[i, s - len(x):] = torch.tensor(x, dtype=torch.long)
            valid[i, s - len(x):] = True
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    return ids.to(device), valid.to(device), positions.to(device)


class LlamaRunner:
    """Offline forwards over `model` (sgl_kvxfer.models.llama.LlamaForCausalLM)."""

    def __init__(self, model):
        self.model = model
        self.cfg = model.config
        self.layers = model.model.layers
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype

    @torch.no_grad()
    def forward(self, ids: torch.Tensor | None, positions: torch.Tensor, valid: torch.Tensor,
                past: KVCache | None = None, kv_layers=(), h_layers=(), resid_layers=(),
                start: int = 0, end: int | None = None, hidden_in: torch.Tensor | None = None,
                logits: str | None = None, return_kv: bool = False):
        """Run layers [start, end) on new tokens [B, S] over an optional prefix cache.

        hidden_in [B, S, hidden]: the residual stream entering layer `start` (else the token
        embeddings, start must be 0). logits: None | "last" | "all" (only when end is the last
        layer). Returns Taps, and with return_kv also the new tokens' (k, v) lists of every
        run layer (for extending the cache)."""
        end = len(self.layers) if end is None else end
        b, s = positions.shape
        x = self.model.model.embed_tokens(ids) if hidden_in is None else hidden_in.to(self.dtype)
        if hidden_in is None and start != 0:
            raise ValueError("a run starting past layer 0 needs hidden_in")
        x = x.reshape(b * s, -1)
        cos, sin = self.model.rotary.cos_sin(positions.reshape(-1), self.dtype)
        plen = 0 if past is None else past.length
        kv_valid = valid if past is None else torch.cat([past.valid, valid], 1)
        qi = torch.arange(s, device=valid.device)[:, None] + plen
        kj = torch.arange(plen + s, device=valid.device)[None, :]
        mask = ((kv_valid[:, None, :] & (kj <= qi)) | (kj == qi)).unsqueeze(1)  # [B, 1, S, P+S]
        c = self.cfg
        taps, new_k, new_v = Taps(), [], []
        for li in range(start, end):
            layer = self.layers[li]
            if li in resid_layers:
                taps.resid[li] = x.view(b, s, -1)
            h = layer.input_layernorm(x)
            if li in h_layers:
                taps.h[li] = h.view(b, s, -1)
            qkv = layer.self_attn.qkv_proj(h)
            q = qkv[:, :c.q_size].view(b * s, c.num_attention_heads, c.head_dim)
            k = qkv[:, c.q_size:c.q_size + c.kv_size].view(b * s, c.num_key_value_heads, c.head_dim)
            v = qkv[:, c.q_size + c.kv_size:].reshape(b, s, c.num_key_value_heads, c.head_dim)
            q, k = fused_ops.rope_qk(q, k, cos, sin)
            k = k.view(b, s, c.num_key_value_heads, c.head_dim)
            if li in kv_layers:
                taps.k[li], taps.v[li] = k, v
            if return_kv:
                new_k.append(k)
                new_v.append(v)
            keys = k if past is None else torch.cat([past.k[li].to(self.dtype), k], 1)
            vals = v if past is None else torch.cat([past.v[li].to(self.dtype), v], 1)
            out = F.scaled_dot_product_attention(
                q.view(b, s, -1, c.head_dim).transpose(1, 2), keys.transpose(1, 2), vals.transpose(1, 2),
                attn_mask=mask, scale=layer.self_attn.scaling, enable_gqa=True)
            x = x + layer.self_attn.o_proj(out.transpose(1, 2).reshape(b * s, c.q_size))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        if logits and end == len(self.layers):
            sel = x.view(b, s, -1)[:, -1:] if logits == "last" else x.view(b, s, -1)
            normed = self.model.model.norm(sel.reshape(-1, sel.shape[-1]))
            taps.logits = self.model.compute_logits(normed).view(b, sel.shape[1], -1)
        if return_kv:
            return taps, new_k, new_v
        return taps

    def prefill_cache(self, ids, positions, valid, h_layers=(), resid_layers=()) -> tuple[KVCache, Taps]:
        """Full prefill of [B, S]; returns its KV as a cache, and the requested taps."""
        taps, k, v = self.forward(ids, positions, valid, h_layers=h_layers, resid_layers=resid_layers,
                                  return_kv=True)
        return KVCache(k, v, valid), taps

    @torch.no_grad()
    def greedy(self, cache: KVCache, first_ids: torch.Tensor, first_pos: torch.Tensor, steps: int,
               stop_ids: tuple[int, ...] = ()) -> list[list[int]]:
        """Greedy decode from a prefix cache: feed first_ids [B] at first_pos [B] (the prompt's
        last token, which the cache does not hold), then `steps` - 1 more. Returns the generated
        ids per row, cut at the first stop id."""
        b = first_ids.shape[0]
        ids, pos = first_ids.view(b, 1), first_pos.view(b, 1)
        one = torch.ones(b, 1, dtype=torch.bool, device=ids.device)
        out = []
        stop = torch.tensor(stop_ids or [-1], device=ids.device)
        done = torch.zeros(b, dtype=torch.bool, device=ids.device)
        for step in range(steps):
            taps, k, v = self.forward(ids, pos, one, past=cache, logits="last", return_kv=True)
            ids = taps.logits[:, -1].argmax(-1, keepdim=True)
            out.append(ids)
            done |= torch.isin(ids[:, 0], stop)
            if step + 1 == steps or bool(done.all()):  # every row has stopped: the rest is cut anyway
                break
            cache = cache.extended(k, v, one)
            pos = pos + 1
        gen = torch.cat(out, 1).tolist()
        res = []
        for row in gen:
            cut = next((i for i, t in enumerate(row) if t in stop_ids), len(row))
            res.append(row[:cut])
        return res
