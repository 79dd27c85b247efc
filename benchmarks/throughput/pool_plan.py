"""KV pool sizes that hold a decode benchmark's workload at a tier budget (plain arithmetic + the
engine's own store planner; unit-tested on CPU).

    plan_pool(arch, dtype, context, batch, budget, n2, policy) -> {"pool_tokens", "kv_pool_bytes",
                                                                   "request_bound", "stores", ...}
    fits(device, plan, headroom)                                -> (ok, bytes needed, bytes free)

Every request lives to its last token: req = context + n2 + SLACK tokens.

b = 1.0   paged fp16 pool: batch x req tokens, whole pages.
b < 1     TieredKVPool. `pool_tokens` (what --max-total-tokens sets) is an fp16-equivalent size:
          the pool takes size x fp16 bytes and splits it into stores by the engine's planner
          (mem_cache.tier_store_plan: staging share, the policy's planned mix, whole int pages).
          The smallest size is searched whose stores hold
            fp16  one whole request (prefill runs in the fp16 store until it is re-tiered) plus
                  every request's fp16 share, sinks, decode window (2R) and generated tokens
            int8  every request's planned int8 share of context + n2, + INT_TAIL_PAGES partly
                  used pages (the tail of its prefill run; its decode demotions share one page
                  at a time: each run continues the previous run's last page)
            int4  likewise
          (a tier that is full falls back one tier up, engine-side). Radix-cached prompts
          then stay resident through the timed calls: nothing is evicted and re-prefilled.
          The staging share (`kv_tier_staging`, the engine's --kv-tier-staging) is searched
          with the size: at each size the smallest share whose fp16 store holds its need, so
          the int stores get the rest (the default 0.25 oversizes the fp16 store at batch 32:
          16k x 32 at b = 0.5 would need a 64.4 GiB pool instead of 51.8).
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.roofline import ModelShape  # noqa: E402

SLACK = 3 * 64  # tokens per request beyond context + n2: the recomputed token, page tails
INT_TAIL_PAGES = 2  # partly used int pages a request holds per tier (prefill run, decode runs)
HEADROOM_BYTES = 6 * 2**30  # activations of a prefill chunk, CUDA graphs, the allocator's slack
FP16_PAGE = 64  # the paged fp16 pool's page (triton backend)
MIN_STAGING, MAX_STAGING = 1e-3, 0.999  # the staging share searched (EngineConfig takes (0, 1))


def _elem(dtype) -> int:
    return torch.finfo(dtype).bits // 8


def full_bytes_per_token(arch, dtype) -> int:
    return 2 * arch.num_hidden_layers * arch.num_key_value_heads * arch.head_dim * _elem(dtype)


def _shape(arch) -> ModelShape:
    return ModelShape.from_arch(arch)


def weight_bytes_read(arch, dtype) -> int:
    """Weights one decode forward reads in full (roofline.ModelShape: layers, norms, lm_head; the
    input embedding is only gathered by row unless tied)."""
    return _shape(arch).weight_bytes_per_forward(_elem(dtype))


def weight_bytes_resident(arch, dtype) -> int:
    """Bytes the model's parameters take (lm_head and the input embedding both, unless tied)."""
    s = _shape(arch)
    embed = 0 if s.tied_embeddings else s.vocab * s.hidden
    return s.weight_bytes_per_forward(_elem(dtype)) + embed * _elem(dtype)


def _tier_needs(arch, context: int, batch: int, n2: int, budget: float, policy: str, page_size: int | None = None):
    """(need16, need8, need4, fractions, config) of the tiered pool for this workload."""
    from sgl_kvxfer.config import EngineConfig
    from sgl_kvxfer.spectrum.budget import KVLayout
    from sgl_kvxfer.spectrum.byte_budget import planned_fractions
    from sgl_kvxfer.spectrum.policies import create_tier_policy

    cfg = EngineConfig(kv_tier_budget=budget, kv_tier_policy=policy, kv_int4="on",
                       **({"kv_tier_page_size": page_size} if page_size else {}))
    group = cfg.resolved_group_size(arch.head_dim)
    f16, f8, f4, _ = planned_fractions(create_tier_policy(policy), budget,
                                       KVLayout(arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim, group),
                                       cfg.kv_budget_unit, cfg.kv_sink_tokens, True)
    req = context + n2 + SLACK
    page = cfg.kv_tier_page_size
    need16 = req + batch * (math.ceil(f16 * context) + cfg.kv_sink_tokens + 2 * cfg.kv_decode_recent + n2)
    need8 = batch * (math.ceil(f8 * (context + n2)) + INT_TAIL_PAGES * page) if f8 > 0 else 0
    need4 = batch * (math.ceil(f4 * (context + n2)) + INT_TAIL_PAGES * page) if f4 > 0 else 0
    return need16, need8, need4, (f16, f8, f4), cfg


def plan_pool(arch, dtype, context: int, batch: int, budget: float, n2: int, policy: str = "greedy",
              page_size: int | None = None) -> dict:
    full = full_bytes_per_token(arch, dtype)
    req = context + n2 + SLACK
    if budget >= 1.0:
        size = batch * math.ceil(req / FP16_PAGE) * FP16_PAGE + FP16_PAGE
        return {"pool_tokens": size, "kv_pool_bytes": size * full, "kv_full_bytes_per_token": full,
                "tokens_needed": batch * req, "stores": None, "request_bound": size}
    from sgl_kvxfer.mem_cache import tier_store_plan

    need16, need8, need4, fractions, cfg = _tier_needs(arch, context, batch, n2, budget, policy, page_size)

    def stores(size: int, staging: float):
        return tier_store_plan(dataclasses.replace(cfg, kv_tier_staging=staging), arch, size, dtype, True)

    def ok(size: int):
        # n16 grows with the staging share (each staged slot costs an fp16 slot, the tiered rest
        # of the memory keeps its mix): the smallest share whose fp16 store holds need16
        lo, hi = MIN_STAGING, MAX_STAGING
        if stores(size, hi).n16 < need16:
            return False, None, hi
        while hi - lo > 1e-4:
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if stores(size, mid).n16 >= need16 else (mid, hi)
        plan = stores(size, hi)
        return plan.n8 >= need8 and plan.n4 >= need4, plan, hi

    hi = max(need16, 16)
    while not ok(hi)[0]:
        hi *= 2
    lo = hi // 2 if hi > 16 else 1  # ok(lo) is False or lo is tiny: search (lo, hi]
    while hi - lo > max(1, hi // 1000):
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid)[0] else (mid, hi)
    _, plan, staging = ok(hi)
    return {"pool_tokens": hi, "kv_pool_bytes": hi * full, "kv_full_bytes_per_token": full,
            "tokens_needed": batch * req, "stores": {"n16": plan.n16, "n8": plan.n8, "n4": plan.n4},
            "store_needs": {"n16": need16, "n8": need8, "n4": need4}, "planned_fractions": fractions,
            "request_bound": plan.n16, "kv_tier_staging": staging}  # exact: the engine rebuilds these stores


def free_device_bytes(device: str) -> int:
    if str(device).startswith("cuda"):
        return torch.cuda.mem_get_info()[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def fits(device: str, plan: dict, headroom: int = HEADROOM_BYTES, free: int | None = None) -> tuple[bool, int, int]:
    """(weights + pool + headroom <= free device memory, that sum, free). CPU: no headroom."""
    free = free_device_bytes(device) if free is None else free
    need = plan["weight_bytes"] + plan["kv_pool_bytes"] + (headroom if str(device).startswith("cuda") else 0)
    return need <= free, need, free
