"""Decode-time attention mass per key: the cold tier's promotion signal.

For one request, one decode query per layer (what the attention backend tapped) and the keys it
attended (read back from the pool, int tiers dequantized):

    p[l, h, j] = softmax_j(q[l, h] . k[l, j, h // G] * scale)     causal over the row, dropped keys masked
    mass[j]    = max over probed layers l and query heads h of p[l, h, j]

The max (not the mean the prefill importance uses) is deliberate: a retrieval head that puts 30%
of its attention on one token while the other heads ignore it is exactly the case worth a
promotion, and the mean over heads would wash it out. A threshold on `mass` is then a threshold
on one head's attention probability, independent of the context length.
"""
from __future__ import annotations

import torch


def head_max_mass(q: torch.Tensor, keys: torch.Tensor, scale: float, valid: torch.Tensor | None = None) -> torch.Tensor:
    """q [Hq, D], keys [T, Hkv, D] (Hq a multiple of Hkv), valid bool [T] or None -> float32 [T]:
    the largest probability any query head gives each key. Batched: q [B, Hq, D], keys
    [B, T, Hkv, D], valid [B, T] -> [B, T], each row its own softmax (padding masked by `valid`;
    a row needs one valid key)."""
    if q.dim() == 2:
        return head_max_mass(q[None], keys[None], scale, None if valid is None else valid[None])[0]
    b, hq, d = q.shape
    _, t, hkv, _ = keys.shape
    if hq % hkv:
        raise ValueError(f"query heads {hq} not a multiple of kv heads {hkv}")
    group = hq // hkv
    # in the keys' dtype (no fp32 copy of every key); the softmax runs in fp32
    logits = torch.einsum("bkgd,btkd->bkgt", q.to(keys.dtype).view(b, hkv, group, d), keys).float() * scale
    if valid is not None:
        logits = logits.masked_fill(~valid.to(logits.device)[:, None, None, :], float("-inf"))
    return torch.softmax(logits, dim=-1).amax(dim=(1, 2))


def extend_runs(picked: torch.Tensor, run: torch.Tensor, cap: int) -> torch.Tensor:
    """bool [T]: `picked` plus the positions of `run` contiguous with a picked one, up to `cap` each
    side of every picked stretch (a dropped line next to a hit comes back whole, bounded)."""
    out = picked.clone()
    for shift in (1, -1):
        front = picked
        for _ in range(cap):
            nxt = torch.zeros_like(front)
            if shift > 0:
                nxt[1:] = front[:-1]
            else:
                nxt[:-1] = front[1:]
            nxt &= run & ~out
            if not bool(nxt.any()):
                break
            out |= nxt
            front = nxt
    return out


def expand_hits(hot: torch.Tensor, eligible: torch.Tensor, radius: int) -> torch.Tensor:
    """bool [T]: eligible positions within `radius` of a hot one (hot itself included when eligible).
    A needle spans several tokens; the head that finds one of them reads its neighbours next."""
    if radius <= 0 or not bool(hot.any()):
        return hot & eligible
    kernel = torch.ones(1, 1, 2 * radius + 1)
    near = torch.nn.functional.conv1d(hot.float().view(1, 1, -1), kernel, padding=radius).view(-1) > 0
    return near & eligible


def extend_runs_rows(picked: torch.Tensor, run: torch.Tensor, cap: int) -> torch.Tensor:
    """extend_runs for every row of bool [n, T] at once, with no host sync: a run position joins
    when the nearest position to its left (right) that is picked or outside the run is a picked
    one at most `cap` away (the chain extend_runs walks, taken in one cummax per side)."""
    out = picked.clone()
    t = picked.shape[-1]
    if t == 0 or cap <= 0:
        return out
    ar = torch.arange(t, device=picked.device).expand_as(picked)
    for flip in (False, True):
        p, r = (picked.flip(-1), run.flip(-1)) if flip else (picked, run)
        src = torch.where(p | ~r, ar, -1).cummax(dim=-1).values  # last source or barrier at or before
        hit = r & ~p & (src >= 0) & p.gather(-1, src.clamp(min=0)) & (ar - src <= cap)
        out |= hit.flip(-1) if flip else hit
    return out


def pool_mass(pool, layers: list[int], queries: dict, block: torch.Tensor, lens: torch.Tensor, scale: float,
              kernel: bool | None = None) -> torch.Tensor:
    """mass [n, W] float32 = max over `layers` of head_max_mass of queries[layer] [n, Hq, D]
    against the keys of the tiered pool's rows `block` [n, W] (slot 0: dropped or padding,
    masked; lens [n] the row lengths, block already 0 past them).

    kernel True: kernels/cold_mass.py reads the pool's stores in place (one launch a layer and a
    few torch ops on all layers' logits, no key copy, no host sync; int stores must be page-head blocks); False: TieredKVPool.route on
    the host and get_k_routed, a padded key block per layer (the CPU path and KIVI pages).
    None: the kernel where it applies (CUDA, page-head blocks in every probed layer)."""
    from sgl_kvxfer.kernels.paged_layout import TierPages
    from sgl_kvxfer.spectrum.tiers import TIER_INT4, TIER_INT8

    if kernel is None:
        kernel = str(block.device).startswith("cuda") and all(
            isinstance(pool.stores[t][layer], TierPages) for t in (TIER_INT8, TIER_INT4) for layer in layers)
    mass = torch.zeros(block.shape, dtype=torch.float32, device=block.device)
    if kernel:
        from sgl_kvxfer.kernels.cold_mass import pool_token_mass_layers

        # one launch per layer, one torch tail for all of them
        return pool_token_mass_layers([queries[layer] for layer in layers], block, lens,
                                      [pool.k16[layer] for layer in layers],
                                      [pool.stores[TIER_INT8][layer] for layer in layers],
                                      [pool.stores[TIER_INT4][layer] for layer in layers],
                                      pool.base(TIER_INT8), pool.base(TIER_INT4), scale, mass)
    route = pool.route(block)
    valid = block != 0
    for layer in layers:
        torch.maximum(mass, head_max_mass(queries[layer], pool.get_k_routed(layer, route), scale, valid), out=mass)
    return mass
