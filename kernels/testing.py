"""Builders of random tiered caches for the kernel tests and benchmarks (no Triton import)."""
from __future__ import annotations

import math

import torch

from .paged_layout import TieredBlockTables, TieredKVLayer, allocate_tiered_layer
from .tier_codec import TIERS, TIER_FP16


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def random_block_tables(lens, page_size: int, device="cpu", seed: int = 0, spare_pages: int = 1):
    """lens: list of (n16, n8, n4) per request. Pages of each tier are handed out in a random
    order (so page ids are not monotone). -> (TieredBlockTables, (P16, P8, P4) pool sizes)."""
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    pools, tables = [], []
    for t in TIERS:
        need = [cdiv(l[t], page_size) for l in lens]
        total = sum(need) + spare_pages
        perm = torch.randperm(total, generator=g).to(torch.int32)
        width = max(1, max(need) if need else 1)
        bt = torch.zeros(B, width, dtype=torch.int32)
        pos = 0
        for b, n in enumerate(need):
            bt[b, :n] = perm[pos:pos + n]
            pos += n
        pools.append(total)
        tables.append(bt.to(device))
    lens_t = tuple(torch.tensor([l[t] for l in lens], dtype=torch.int32, device=device)
                   for t in TIERS)
    return TieredBlockTables(tuple(tables), lens_t), tuple(pools)


def slots_for(tables: TieredBlockTables, page_size: int):
    """Destination (tier, page, offset) int32 [N] of every cached token, request-major, tier
    order fp16 -> int8 -> int4 (the order gather_request_kv returns)."""
    tiers, pages, offs = [], [], []
    for b in range(tables.batch_size):
        for t in TIERS:
            n = int(tables.lens[t][b])
            i = torch.arange(n)
            tiers.append(torch.full((n,), t, dtype=torch.int32))
            pages.append(tables.tables[t][b].cpu()[i // page_size])
            offs.append((i % page_size).to(torch.int32))
    dev = tables.lens[0].device
    return tuple(torch.cat(x).to(torch.int32).to(dev) for x in (tiers, pages, offs))


def build_random_cache(lens, num_kv_heads: int, head_dim: int, group_size: int, page_size: int,
                       dtype=torch.float16, device="cpu", seed: int = 0):
    """Random K/V for every cached token, stored at its tier (TierPages.write: tier_codec).
    -> (layer, tables, (k, v) [N, Hkv, D] originals, request-major, tier order 16/8/4)."""
    tables, pools = random_block_tables(lens, page_size, device, seed)
    layer = allocate_tiered_layer(pools, page_size, num_kv_heads, head_dim, group_size, dtype,
                                  device, fill=0.0)
    tiers, pages, offs = slots_for(tables, page_size)
    g = torch.Generator().manual_seed(seed + 1)
    N = tiers.shape[0]
    k = torch.randn(N, num_kv_heads, head_dim, generator=g).to(dtype).to(device)
    v = torch.randn(N, num_kv_heads, head_dim, generator=g).to(dtype).to(device)
    for t in TIERS:
        m = tiers == t
        if bool(m.any()):
            layer[t].write(pages[m].long(), offs[m].long(), k[m], v[m])
    return layer, tables, (k, v)


def build_random_paged_cache(lens, num_kv_heads: int, head_dim: int, group_size: int, page_sizes,
                             dtype=torch.float16, device="cpu", seed: int = 0, filled: bool = True,
                             spare_pages: int = 2, extra_cols: int = 1):
    """A layer whose tiers have their own page sizes (e.g. (1, 16, 64): the engine's fp16 rows and
    paged int stores), every slot of every page holding codec-valid data (random normals,
    quantized), and tables over it. lens: (n16, n8, n4) per request.

    filled=True: the filled form. Each request lists distinct random pages per tier (requests may
    share pages, as radix hits do) with random fills in [0, PAGE] (some pages partial or empty in
    the middle, the last one whatever is left), sum(fills) == n_t. filled=False: the dense form
    (full pages, the last one partial). `extra_cols` unused table columns hold valid page ids.
    -> (layer, tables)."""

    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    pages, fills = [], []  # per tier: per request list of (page ids, fills)
    for t in TIERS:
        P = page_sizes[t]
        per_req = []
        for lb in lens:
            n, f = int(lb[t]), []
            while n > 0:
                if not filled:
                    take = min(P, n)
                else:
                    r = float(torch.rand((), generator=g))
                    take = 0 if r < 0.1 else min(n, int(torch.randint(1, P + 1, (), generator=g)))
                f.append(take)
                n -= take
            per_req.append(f)
        fills.append(per_req)
    pools = tuple(max([len(f) for f in fills[t]] + [0]) + spare_pages for t in TIERS)
    tables, fill_t, npg_t = [], [], []
    for t in TIERS:
        width = max(1, max(len(f) for f in fills[t]) + extra_cols)
        bt = torch.randint(0, pools[t], (B, width), generator=g, dtype=torch.int32)
        ft = torch.randint(0, page_sizes[t] + 1, (B, width), generator=g, dtype=torch.int32)
        for b, f in enumerate(fills[t]):
            bt[b, :len(f)] = torch.randperm(pools[t], generator=g)[:len(f)].to(torch.int32)
            ft[b, :len(f)] = torch.tensor(f, dtype=torch.int32)
        tables.append(bt.to(device))
        fill_t.append(ft.to(device))
        npg_t.append(torch.tensor([len(f) for f in fills[t]], dtype=torch.int32, device=device))
    lens_t = tuple(torch.tensor([int(l[t]) for l in lens], dtype=torch.int32, device=device) for t in TIERS)
    tables = (TieredBlockTables(tuple(tables), lens_t, tuple(fill_t), tuple(npg_t)) if filled
              else TieredBlockTables(tuple(tables), lens_t))

    layer = allocate_tiered_layer(pools, page_sizes, num_kv_heads, head_dim, group_size, dtype, device, fill=0.0)
    for t in TIERS:  # every slot of every page holds codec-valid data
        P = page_sizes[t]
        page = torch.arange(pools[t]).repeat_interleave(P).to(device)
        off = torch.arange(P).repeat(pools[t]).to(device)
        k = torch.randn(pools[t] * P, num_kv_heads, head_dim, generator=g).to(dtype).to(device)
        v = torch.randn(pools[t] * P, num_kv_heads, head_dim, generator=g).to(dtype).to(device)
        layer[t].write(page, off, k, v)
    return layer, tables


def fill_random_pools(layer: TieredKVLayer, seed: int = 0) -> None:
    """Fill every pool with valid random contents in place (benchmarks: values don't matter
    for timing, but must be finite)."""
    g = torch.Generator(device=layer[0].k.device).manual_seed(seed)
    for t in TIERS:
        tp = layer[t]
        if t == TIER_FP16:
            for x in (tp.k, tp.v):
                x.normal_(generator=g)
            continue
        for x in (tp.k, tp.v):
            x.random_(0, 256, generator=g)
        for s in (tp.k_scale, tp.v_scale):  # views into the blocks: fill through a copy
            s.copy_(torch.empty(s.shape, dtype=s.dtype, device=s.device).uniform_(0.001, 0.02, generator=g))
        for z in (tp.k_zero, tp.v_zero):
            z.copy_(torch.empty(z.shape, dtype=z.dtype, device=z.device).uniform_(-1.0, 0.0, generator=g))


# max |kernel - attention(original fp16 K/V)| per tier mix: what each tier's quantization costs
TIER_ATOL = {"fp16": 4e-3, "int8": 2e-2, "int4": 2.5e-1, "mixed": 2.5e-1}


def exact_attention(q, k, v, lens, group: int) -> torch.Tensor:
    """fp32 attention of q [B, Hq, D] over the ORIGINAL (unquantized) k, v [N, Hkv, D], whose
    rows are the requests' tokens back to back (request b has sum(lens[b]) rows); GQA group
    `group`. A request with no tokens gets 0."""
    out, pos = [], 0
    for b, lb in enumerate(lens):
        n = sum(lb)
        kb = k[pos:pos + n].float().repeat_interleave(group, 1)
        vb = v[pos:pos + n].float().repeat_interleave(group, 1)
        pos += n
        if n == 0:
            out.append(torch.zeros(q.shape[1:], device=q.device))
            continue
        s = torch.einsum("hd,nhd->hn", q[b].float(), kb) / math.sqrt(q.shape[-1])
        out.append(torch.einsum("hn,nhd->hd", s.softmax(-1), vb))
    return torch.stack(out)


def rope_rounding_bound(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Per-element bound on |kernel - torch| for RoPE of x [T, H, D] (cos/sin [T, 1, D/2]) when
    a compiler contracts the products into the add/sub instead of rounding each (torch rounds
    x1*c and x2*s to the dtype first). Output [lo | hi] = [x1 c - x2 s | x2 c + x1 s]: each
    half is off by at most ~eps of its own products' magnitudes, 2 eps (|a| + |b|) with margin,
    plus 1e-4 for fp16 subnormals."""
    eps = torch.finfo(x.dtype).eps
    x, c, s = x.float(), cos.float(), sin.float()
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    lo = x1.abs() * c.abs() + x2.abs() * s.abs()
    hi = x2.abs() * c.abs() + x1.abs() * s.abs()
    return 2 * eps * torch.cat([lo, hi], dim=-1) + 1e-4


def assert_rope_close(got: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> None:
    """A RoPE kernel's output vs torch's for input x: bitwise under the interpreter, within
    `rope_rounding_bound` when compiled for a GPU (the compiler may contract the products)."""
    if not got.is_cuda:
        assert torch.equal(got, ref)
        return
    err = (got.float() - ref.float()).abs()
    bound = rope_rounding_bound(x, cos, sin)
    assert bool((err <= bound).all()), f"max excess {float((err - bound).max()):.3g}"
