"""End-to-end decode throughput through the Engine's scheduler, per SpectrumKV tier budget.

`batch` requests of `context` distinct random tokens each (dummy weights, realistic shapes) are
prefilled once, then every request decodes together in phases, one per `--backends` entry, the
runner's attention backend swapped between phases (the torch backend reads the same pool through
get_kv). Each timed step is one full scheduler iteration (schedule, allocate, forward, sample),
synchronized. Reports the median decode step, tokens/s (= batch / step), the resident KV bytes
(per context token and vs fp16) and the weights + KV bytes roofline at the measured copy bandwidth.

Each `--kv-tier-budgets` entry is a fresh engine with `--attention-backend triton`:
    b = 1.0   untiered: paged fp16 pool (page 64), paged Triton kernels for prefill and decode
    b < 1     TieredKVPool (greedy policy, bytes unit, int4 on): decode runs the token-gather
              kernel; prefill runs the torch extend path (the tiered backend delegates it), so it
              uses a smaller chunk (--tiered-chunked-prefill-size; see run()'s NOTE)
Prefill time is reported too (it includes the Triton JIT of the first chunk).

    python benchmarks/throughput/e2e_decode.py --preset llama-3-8b --context 32768 --batch 8 \
        --kv-tier-budgets 1.0 0.5 0.25
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.report import device_name, git_commit, write_json  # noqa: E402
from common.roofline import copy_bandwidth  # noqa: E402


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def decode_steps(sched, n: int) -> list[float]:
    times = []
    for _ in range(n):
        sync()
        t = time.perf_counter()
        sched.step()
        sync()
        times.append(time.perf_counter() - t)
    return times


def tiered_pool_size(args, budget: float, total: int) -> tuple[int, float]:
    """(max_total_tokens, kv_tier_staging) for a TieredKVPool that holds every request at the
    policy's planned tier mix, plus, in the fp16 staging store, one whole request (tokens are
    tiered when their prefill ends, so the request being prefilled is all fp16) and every
    request's fp16 decode window (< 2 x kv_decode_recent) and decode tokens. tier_plan.py's
    arithmetic, inverted; 5% slack on the tiered part."""
    from sgl_kvxfer.config import EngineConfig
    from sgl_kvxfer.kernels.tier_codec import payload_bytes
    from sgl_kvxfer.models.presets import PRESETS
    from sgl_kvxfer.spectrum.budget import KVLayout
    from sgl_kvxfer.spectrum.byte_budget import planned_fractions
    from sgl_kvxfer.spectrum.policies import create_tier_policy

    cfg, arch = EngineConfig(), PRESETS[args.preset]
    layers, heads = arch["num_hidden_layers"], arch["num_key_value_heads"]
    dim = arch.get("head_dim") or arch["hidden_size"] // arch["num_attention_heads"]
    group = cfg.kv_quant_group_size
    elem = 4 if args.dtype in ("float", "float32") else 2
    b16, b8, b4 = (2 * layers * heads * payload_bytes(t, dim, group, elem) for t in (0, 1, 2))
    layout = KVLayout(layers, heads, dim, group)
    f16, f8, f4 = planned_fractions(create_tier_policy(args.kv_tier_policy), budget, layout, cfg.kv_budget_unit,
                                    cfg.kv_sink_tokens, True)[:3]
    resident = (f16 + f8 + f4) or 1.0  # dropped tokens take no slot
    mix_bytes = (f16 * b16 + f8 * b8 + f4 * b4) / resident if f16 + f8 + f4 else b16
    stage = args.context + args.batch * (2 * cfg.kv_decode_recent + total) + 2048
    tiered = 1.05 * args.batch * (args.context + total) * resident
    size = int((stage * b16 + tiered * mix_bytes) / b16) + 2
    return size, stage / size


def engine_kwargs(args, budget: float, total: int) -> dict:
    kw = dict(load_format="dummy", dtype=args.dtype, attention_backend="triton", max_running_requests=args.batch)
    if budget >= 1.0:
        chunk = args.chunked_prefill_size
        kw["max_total_tokens"] = args.batch * (args.context + total + 2 * 64) + 1024
    else:
        chunk = args.tiered_chunked_prefill_size
        size, staging = tiered_pool_size(args, budget, total)
        kw.update(kv_tier_budget=budget, kv_tier_policy=args.kv_tier_policy, kv_int4="on",
                  max_total_tokens=size, kv_tier_staging=staging)
    return dict(kw, chunked_prefill_size=chunk, max_prefill_tokens=chunk)


def resident_kv(runner, kv_tokens: int) -> dict:
    """KV bytes held now (scales included). Tiered: per store from the allocator's occupancy
    (dropped tokens hold nothing); paged fp16: context tokens x full bytes."""
    pool, full = runner.kv_pool, runner.kv_pool.bytes_per_token()
    if getattr(pool, "layout", "") != "tiered":
        return {"kv_resident_bytes": kv_tokens * full, "kv_full_bytes_per_token": full, "kv_tier_slots_used": None}
    used = runner.allocator.used_counts()
    return {"kv_resident_bytes": float(sum(c * pool.token_bytes(t) for t, c in used.items())),
            "kv_full_bytes_per_token": float(pool.full_bytes_per_token()),
            "kv_tier_slots_used": [used[t] for t in (0, 1, 2)]}


def run(args, model_dir: str, prompts: list[list[int]], budget: float) -> dict:
    """Prefill once (triton backend), then time decode with each backend in turn on the SAME
    requests and pool (the runner's backend object is swapped between phases).

    NOTE: torch-backend extend at 32k materializes scores: SDPA with a mask and enable_gqa falls
    back to the math kernel, [Hq, chunk, context] fp32 per call (8 GiB at 32 heads, chunk 2048,
    32k). The untiered triton backend prefills with the paged extend kernel; the tiered one
    delegates extend to the torch backend, hence --tiered-chunked-prefill-size."""
    from sgl_kvxfer import Engine
    from sgl_kvxfer.layers.attention import create_attention_backend
    from sgl_kvxfer.message import TokenizedGenerateReq
    from sgl_kvxfer.sampling.params import SamplingParams

    phases = args.backends
    total = len(phases) * (args.warmup + args.steps) + 2
    kw = engine_kwargs(args, budget, total)
    engine = Engine(model_dir, **kw)
    runner, sched = engine.runner, engine.scheduler
    params = SamplingParams.from_dict({"max_new_tokens": total, "temperature": 0, "ignore_eos": True})
    for i, ids in enumerate(prompts):
        sched.handle(TokenizedGenerateReq(rid=f"r{i}", input_ids=ids, sampling=params))
    sync()
    t0 = time.perf_counter()
    while sched.waiting or sched.chunked:
        sched.step()
    sync()
    prefill_s = time.perf_counter() - t0
    assert len(sched.running) == args.batch, "every request must decode together"
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    backends = {"triton": runner.attn_backend}
    tiered = budget < 1.0
    out = {"kv_tier_budget": budget, "pool": type(runner.kv_pool).__name__, "page_size": runner.page_size,
           "dtype": str(runner.dtype), "engine_kwargs": kw,
           "decode_backend": type(runner.attn_backend).__name__,
           "prefill_backend": "torch (delegated extend)" if tiered else "triton",
           "prefill_s": prefill_s, "prefill_tok_s": args.batch * args.context / prefill_s,
           "weight_bytes": weight_bytes, "phases": []}
    if tiered:
        recs = list(sched.tiering.records)
        out["tier_records"] = {"runs": len(recs), "fallback_runs": sum(r.asked != r.got for r in recs),
                               "asked": [sum(r.asked[t] for r in recs) for t in range(4)],
                               "got": [sum(r.got[t] for r in recs) for t in range(4)]}
        out["kv_tier_slots"] = [runner.kv_pool.plan.n16, runner.kv_pool.plan.n8, runner.kv_pool.plan.n4]
    for name in phases:
        if name not in backends:
            backends[name] = create_attention_backend(
                name, kv_pool=runner.kv_pool, num_q_heads=runner.arch.num_attention_heads,
                num_kv_heads=runner.arch.num_key_value_heads, head_dim=runner.arch.head_dim)
        runner.attn_backend = backends[name]
        decode_steps(sched, args.warmup)  # Triton autotune / JIT, allocator warm-up
        times = decode_steps(sched, args.steps)
        assert len(sched.running) == args.batch
        step = statistics.median(times)
        ctx = sum(r.kv_len for r in sched.running)
        kv = resident_kv(runner, ctx)
        out["phases"].append({
            "backend": name, "backend_class": type(backends[name]).__name__,
            "decode_step_median_s": step, "decode_step_min_s": min(times),
            "decode_tok_s": args.batch / step, "kv_tokens": ctx, **kv,
            "kv_bytes_per_context_token": kv["kv_resident_bytes"] / ctx,
            "kv_fraction_of_fp16": kv["kv_resident_bytes"] / (ctx * kv["kv_full_bytes_per_token"]),
            "kv_bytes_per_step": kv["kv_resident_bytes"]})
    engine.shutdown()
    del engine, runner, sched, backends
    gc.collect()
    torch.cuda.empty_cache()
    return out


def plot(path_png: str, title: str, runs: list[dict]) -> bool:
    """Decode tok/s per budget and backend (best phase) | resident KV bytes vs fp16."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = sorted({ph["backend"] for r in runs for ph in r["phases"]})
    labels = [f"b={r['kv_tier_budget']:g}" for r in runs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        tok = [max((ph["decode_tok_s"] for ph in r["phases"] if ph["backend"] == name), default=0.0) for r in runs]
        ax1.bar([x + i * width for x in range(len(runs))], tok, width, label=name)
    ax1.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(runs))], labels)
    ax1.set_ylabel("decode tok/s (batch / median step)")
    ax1.legend()
    frac = [r["phases"][-1]["kv_fraction_of_fp16"] for r in runs]
    ax2.bar(labels, frac, color="tab:gray")
    for x, f in enumerate(frac):
        ax2.text(x, f, f"{f:.3f}", ha="center", va="bottom")
    ax2.set_ylabel("resident KV bytes / fp16 bytes")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path_png, dpi=120)
    plt.close(fig)
    return True


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="llama-3-8b")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--chunked-prefill-size", type=int, default=8192)
    p.add_argument("--tiered-chunked-prefill-size", type=int, default=2048,
                   help="prefill chunk at b < 1 (torch extend path; bounds its [Hq, chunk, context] scores)")
    p.add_argument("--kv-tier-budgets", type=float, nargs="+", default=[1.0],
                   help="one engine per budget; 1.0 = untiered paged pool, < 1 = tiered pool")
    p.add_argument("--kv-tier-policy", default="greedy")
    p.add_argument("--backends", nargs="+", default=["triton", "torch", "triton"],
                   help="decode phases, in order, on the same running requests")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA device"
    assert all(0.0 < b <= 1.0 for b in args.kv_tier_budgets), args.kv_tier_budgets

    from sgl_kvxfer.models.presets import PRESETS, write_dummy_tokenizer, write_preset_config

    model_dir = write_preset_config(args.preset, tempfile.mkdtemp(prefix="e2e_decode_"))
    vocab = PRESETS[args.preset]["vocab_size"]
    write_dummy_tokenizer(model_dir, vocab)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(args.context)] for _ in range(args.batch)]
    bw = copy_bandwidth()
    tiered = any(b < 1.0 for b in args.kv_tier_budgets)
    name = f"e2e_decode_{'tiered_' if tiered else ''}{args.preset}_{device_name('cuda').replace(' ', '_')}"
    runs = []
    for budget in args.kv_tier_budgets:
        result = run(args, model_dir, prompts, budget)
        for ph in result["phases"]:
            ph["roofline_step_s"] = (result["weight_bytes"] + ph["kv_bytes_per_step"]) / bw
            ph["fraction_of_roofline"] = ph["roofline_step_s"] / ph["decode_step_median_s"]
            print(f"b={budget:<5g} {ph['backend']:7s}: decode {ph['decode_tok_s']:8.1f} tok/s "
                  f"(step {ph['decode_step_median_s'] * 1e3:7.2f} ms, {ph['fraction_of_roofline']:.0%} of the "
                  f"weights+KV roofline {ph['roofline_step_s'] * 1e3:.2f} ms); KV "
                  f"{ph['kv_bytes_per_context_token'] / 1024:.1f} KiB/token ({ph['kv_fraction_of_fp16']:.3f} of fp16)")
        print(f"b={budget:<5g} prefill ({result['prefill_backend']}, page {result['page_size']}): "
              f"{result['prefill_s']:.1f} s, {result['prefill_tok_s']:.0f} tok/s")
        best = {}
        for ph in result["phases"]:
            best[ph["backend"]] = max(best.get(ph["backend"], 0.0), ph["decode_tok_s"])
        if "triton" in best and "torch" in best:
            print(f"b={budget:<5g} triton / torch decode speed-up: {best['triton'] / best['torch']:.2f}x")
        runs.append(result)
    payload = {"device": device_name("cuda"), "commit": git_commit(), "torch": torch.__version__,
               "params": vars(args), "copy_bandwidth_Bps": bw, "runs": runs}
    path = write_json(name, payload, args.out_dir)
    print("wrote", path)
    title = (f"e2e decode, {args.preset} dummy, ctx {args.context} x batch {args.batch}, {payload['device']}\n"
             f"triton backend: b=1 paged fp16, b<1 tiered pool + token-gather decode")
    if plot(path[:-5] + ".png", title, runs):
        print("wrote", path[:-5] + ".png")


if __name__ == "__main__":
    main()
