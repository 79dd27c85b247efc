"""Reference attention backend in plain torch (CPU and GPU, exact up to SDPA's math).

Decode: one padded gather per layer.  slots [B, Lmax] = req_to_token rows, padded with slot 0,
and a key mask [B, 1, 1, Lmax] that hides the padding.
Extend: one SDPA call per request over its whole sequence (prefix from the pool + new tokens),
with a causal mask shifted by the prefix length (pools with `drops_tokens` also mask prefix keys
whose slot is 0: SpectrumKV's dropped tokens):

    keys:      0 ........ prefix-1 | prefix ........ seq-1
    query j:   all visible         | visible iff key <= prefix + j
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sgl_kvxfer.forward_batch import ForwardBatch, ForwardMode
from sgl_kvxfer.layers.attention.base import AttentionBackend


@dataclass
class _DecodePlan:
    slots: torch.Tensor  # int64 [B, Lmax]
    key_mask: torch.Tensor  # bool [B, 1, 1, Lmax]


@dataclass
class _ExtendPlan:
    slots: list[torch.Tensor]  # per request int64 [seq_len]
    masks: list[torch.Tensor | None]  # per request bool [E, seq_len], None = plain causal
    token_offsets: list[int]  # start of request i's run in the flattened tokens


class TorchAttentionBackend(AttentionBackend):
    def prepare_metadata(self, batch: ForwardBatch) -> None:
        table = batch.req_to_token
        if batch.mode == ForwardMode.DECODE:
            lmax = max(batch.seq_lens_cpu)
            rows = table[batch.req_pool_indices, :lmax]
            cols = torch.arange(lmax, device=rows.device)
            valid = cols[None, :] < batch.seq_lens[:, None]
            if self.kv_pool.drops_tokens:  # SpectrumKV TIER_DROP: slot 0 inside a row is masked
                valid &= rows != 0
            batch.attn_metadata = _DecodePlan(torch.where(valid, rows, 0), valid[:, None, None, :])
            return
        slots, masks, offsets, start = [], [], [], 0
        for i, (prefix, extend) in enumerate(zip(batch.extend_prefix_lens, batch.extend_seq_lens)):
            seq = prefix + extend
            slots.append(table[int(batch.req_pool_indices[i]), :seq])
            dropped = self.kv_pool.drops_tokens and bool((slots[-1][:prefix] == 0).any())
            if prefix == 0:
                masks.append(None)
            else:
                q_pos = torch.arange(prefix, seq, device=table.device)[:, None]
                mask = torch.arange(seq, device=table.device)[None, :] <= q_pos
                masks.append(mask & (slots[-1] != 0)[None, :] if dropped else mask)
            offsets.append(start)
            start += extend
        batch.attn_metadata = _ExtendPlan(slots, masks, offsets)

    def forward(self, q, k, v, layer_id, batch):
        pool = self.kv_pool
        pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        plan = batch.attn_metadata
        if batch.mode == ForwardMode.DECODE:
            keys, values = pool.get_kv(layer_id, plan.slots)  # [B, L, Hkv, D]
            out = F.scaled_dot_product_attention(
                q[:, :, None, :], keys.transpose(1, 2), values.transpose(1, 2),
                attn_mask=plan.key_mask, scale=self.scale, enable_gqa=True)
            return out[:, :, 0, :]
        out = torch.empty_like(q)
        for i, extend in enumerate(batch.extend_seq_lens):
            s = plan.token_offsets[i]
            if batch.extend_prefix_lens[i] == 0 and pool.stores_exact and k.dtype == pool.dtype:
                keys, values = k[s : s + extend], v[s : s + extend]  # == the pool's rows, no gather
            else:
                keys, values = pool.get_kv(layer_id, plan.slots[i])  # [S, Hkv, D]
            qi = q[s : s + extend].transpose(0, 1)[None]  # [1, Hq, E, D]
            mask = plan.masks[i]
            oi = F.scaled_dot_product_attention(
                qi, keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=True)
            out[s : s + extend] = oi[0].transpose(0, 1)
            observer = batch.extras.get("attn_observer")
            if observer is not None:
                observer(layer_id, i, qi[0].transpose(0, 1), keys)
        return out
