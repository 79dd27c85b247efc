"""End-to-end decode throughput through the offline Engine, per SpectrumKV tier budget.

`batch` requests of `context` random tokens each (dummy weights, realistic shapes) run through
`Engine.generate` only, the public entry point. Per budget and attention backend, one engine:

    1. prefill: generate(max_new_tokens=1) on every prompt (timed: includes the Triton JIT)
    2. decode:  generate(max_new_tokens=n1) and generate(max_new_tokens=n2) on the same prompts,
       each `--repeats` times. The prompts are radix-cache hits by then (one token each is
       recomputed), so both calls pay the same small prefill and the decode step is
           step = (T(n2) - T(n1)) / (n2 - n1)      (medians of the repeats)
       which takes every per-step cost the engine has (scheduling, allocation, forward,
       sampling, demotion of old tokens at b < 1) and nothing else.

The pool is sized to hold every request to its last token, from what the device has: the batch
shrinks (and the result says so) when `batch x (context + n2)` tokens do not fit next to the
weights. Reports tokens/s (= batch / step), resident KV bytes (per context token, and vs fp16)
and the weights + KV bytes roofline of the step at the measured copy bandwidth.

    python benchmarks/throughput/e2e_decode.py --preset llama-3-8b --context 16384 32768 \
        --batch 8 32 --kv-tier-budgets 1.0 0.5 0.25              # GPU
    python benchmarks/throughput/e2e_decode.py --preset tiny --context 128 --batch 2 \
        --n1 2 --n2 4 --repeats 1 --device cpu                       # CPU smoke run
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
from common.report import device_name, git_commit, triton_interpreter_for, write_json  # noqa: E402
from common.roofline import copy_bandwidth  # noqa: E402

HEADROOM_BYTES = 6 * 2**30  # activations of a prefill chunk, CUDA graphs, the allocator's slack


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def kv_bytes_per_token(preset: dict, dtype: str) -> float:
    dim = preset.get("head_dim") or preset["hidden_size"] // preset["num_attention_heads"]
    elem = 4 if dtype in ("float", "float32") else 2
    return 2.0 * preset["num_hidden_layers"] * preset["num_key_value_heads"] * dim * elem


def weight_bytes(preset: dict, dtype: str) -> float:
    h, i, v, n = preset["hidden_size"], preset["intermediate_size"], preset["vocab_size"], preset["num_hidden_layers"]
    dim = preset.get("head_dim") or h // preset["num_attention_heads"]
    qkv = h * dim * (preset["num_attention_heads"] + 2 * preset["num_key_value_heads"])
    per_layer = qkv + preset["num_attention_heads"] * dim * h + 3 * h * i + 2 * h
    elem = 4 if dtype in ("float", "float32") else 2
    return float(elem * (n * per_layer + v * h * (1 if preset.get("tie_word_embeddings") else 2) + h))


def fit_batch(args, preset: dict, context: int, batch: int) -> tuple[int, int]:
    """(batch that fits, pool tokens it needs): every request to its last token, in the KV
    memory the device has after the weights and HEADROOM_BYTES. An fp16 pool of this size also
    holds the tiered pools of b < 1 (they get the same memory, divided into smaller tiers)."""
    need_per_req = context + args.n2 + 2 * 64 + 64  # + the decode window and a page of slack
    if args.device == "cpu":
        return batch, batch * need_per_req + 1024
    free, _ = torch.cuda.mem_get_info()
    kv_room = free - weight_bytes(preset, args.dtype) - HEADROOM_BYTES
    fits = int(kv_room // (need_per_req * kv_bytes_per_token(preset, args.dtype)))
    if fits < 1:
        raise SystemExit(f"context {context} does not fit this device even at batch 1 "
                         f"({free / 2**30:.1f} GiB free)")
    batch = min(batch, fits)
    return batch, batch * need_per_req + 1024


def engine_kwargs(args, preset: dict, budget: float, backend: str, pool_tokens: int, batch: int) -> dict:
    kw = dict(load_format="dummy", dtype=args.dtype, device=args.device, attention_backend=backend,
              max_running_requests=batch, max_total_tokens=pool_tokens, chunked_prefill_size=args.chunk,
              max_prefill_tokens=args.chunk)
    if args.device != "cpu":
        # what is used now + the weights + the pool, as a fraction (the pool is capped at
        # max_total_tokens anyway; engine/memory.py)
        free, total = torch.cuda.mem_get_info()
        need = total - free + weight_bytes(preset, args.dtype) + pool_tokens * args.kv_bytes + 2**30
        kw["mem_fraction_static"] = min(0.95, need / total)
    if budget < 1.0:
        # `greedy` at the budget; int4 forced on (the probe decides int4 for real models only)
        kw.update(kv_tier_budget=budget, kv_tier_policy=args.kv_tier_policy, kv_int4="on")
    return kw


def timed_generate(engine, prompts, n: int) -> float:
    params = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    sync()
    t = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    sync()
    assert all(o["meta_info"]["completion_tokens"] == n for o in outs)
    return time.perf_counter() - t


def resident_kv(engine, kv_tokens: int, full: float) -> dict:
    """KV held now (scales included): the pool's resident bytes per token (what /server_info
    reports) x the tokens a decode step reads; `full` is the fp16 pool's bytes per token."""
    per_token = float(engine.get_server_info()["kv_bytes_per_token"])
    return {"kv_bytes_per_token": per_token, "kv_full_bytes_per_token": full,
            "kv_fraction_of_fp16": per_token / full, "kv_resident_bytes": per_token * kv_tokens}


def run_point(args, model_dir: str, preset: dict, context: int, batch: int, budget: float, backend: str) -> dict:
    from sgl_kvxfer import Engine

    fitted, pool_tokens = fit_batch(args, preset, context, batch)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, preset["vocab_size"]) for _ in range(context)] for _ in range(fitted)]
    kw = engine_kwargs(args, preset, budget, backend, pool_tokens, fitted)
    engine = Engine(model_dir, **kw)
    prefill_s = timed_generate(engine, prompts, 1)
    t1, t2 = [], []
    for _ in range(args.repeats):
        t1.append(timed_generate(engine, prompts, args.n1))
        t2.append(timed_generate(engine, prompts, args.n2))
    step = (statistics.median(t2) - statistics.median(t1)) / (args.n2 - args.n1)
    kv = resident_kv(engine, fitted * (context + (args.n1 + args.n2) // 2), args.kv_bytes)
    wbytes = weight_bytes(preset, args.dtype)
    engine.shutdown()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    out = {"context": context, "batch": fitted, "batch_asked": batch, "kv_tier_budget": budget, "backend": backend,
           "engine_kwargs": kw, "prefill_s": prefill_s, "prefill_tok_s": fitted * context / prefill_s,
           "generate_s": {"n1": t1, "n2": t2}, "decode_step_s": step, "decode_tok_s": fitted / step,
           "weight_bytes": wbytes, **kv}
    if args.bandwidth:
        out["roofline_step_s"] = (wbytes + kv["kv_resident_bytes"]) / args.bandwidth
        out["fraction_of_roofline"] = out["roofline_step_s"] / step
    return out


def plot(path_png: str, title: str, rows: list[dict]) -> bool:
    """Decode tok/s per (context, batch) and budget | fraction of the weights+KV roofline."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    shapes = sorted({(r["context"], r["batch_asked"]) for r in rows})
    series = sorted({(r["kv_tier_budget"], r["backend"]) for r in rows}, reverse=True)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / max(1, len(series))
    for i, (budget, backend) in enumerate(series):
        pick = {(r["context"], r["batch_asked"]): r for r in rows if (r["kv_tier_budget"], r["backend"]) == (budget, backend)}
        xs = [x + i * width for x in range(len(shapes))]
        label = f"b={budget:g} {backend}"
        axes[0].bar(xs, [pick[s]["decode_tok_s"] if s in pick else 0 for s in shapes], width, label=label)
        axes[1].bar(xs, [pick[s].get("fraction_of_roofline", 0) if s in pick else 0 for s in shapes], width,
                    label=label)
    ticks = [x + width * (len(series) - 1) / 2 for x in range(len(shapes))]
    for ax, ylabel in zip(axes, ("decode tok/s (batch / step)", "weights+KV roofline / measured step")):
        ax.set_xticks(ticks, [f"ctx {c}\nbatch {b}" for c, b in shapes])
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path_png, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="llama-3-8b")
    p.add_argument("--context", type=int, nargs="+", default=[16384, 32768])
    p.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    p.add_argument("--kv-tier-budgets", type=float, nargs="+", default=[1.0, 0.5, 0.25],
                   help="one engine per budget; 1.0 = untiered pool, < 1 = SpectrumKV tiers")
    p.add_argument("--kv-tier-policy", default="greedy")
    p.add_argument("--backends", nargs="+", default=["triton"], help="attention backends, one engine each")
    p.add_argument("--n1", type=int, default=16, help="decode tokens of the short generate call")
    p.add_argument("--n2", type=int, default=80, help="decode tokens of the long generate call")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--chunk", type=int, default=8192, help="--chunked-prefill-size and --max-prefill-tokens")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not all(0.0 < b <= 1.0 for b in args.kv_tier_budgets) or args.n2 <= args.n1:
        p.error("budgets must be in (0, 1] and --n2 > --n1")
    triton_interpreter_for(args.device)  # a CPU run's triton backend runs in Triton's interpreter

    from sgl_kvxfer.models.presets import PRESETS, write_dummy_tokenizer, write_preset_config

    preset = PRESETS[args.preset]
    args.kv_bytes = kv_bytes_per_token(preset, args.dtype)
    args.bandwidth = copy_bandwidth() if args.device != "cpu" else None
    device = device_name(args.device)
    rows = []
    with tempfile.TemporaryDirectory(prefix="e2e_decode_") as model_dir:
        write_preset_config(args.preset, model_dir)
        write_dummy_tokenizer(model_dir, preset["vocab_size"])
        for context in args.context:
            for batch in args.batch:
                for budget in args.kv_tier_budgets:
                    for backend in args.backends:
                        r = run_point(args, model_dir, preset, context, batch, budget, backend)
                        rows.append(r)
                        roof = f", {r['fraction_of_roofline']:.0%} of roofline" if "fraction_of_roofline" in r else ""
                        print(f"ctx {context} batch {r['batch']} b={budget:g} {backend}: {r['decode_tok_s']:.1f} tok/s "
                              f"(step {r['decode_step_s'] * 1e3:.2f} ms{roof}); KV {r['kv_fraction_of_fp16']:.3f} of "
                              f"fp16; prefill {r['prefill_s']:.1f} s", flush=True)
    params = {k: v for k, v in vars(args).items() if k not in ("bandwidth", "kv_bytes")}
    payload = {"benchmark": "e2e_decode", "device": device, "commit": git_commit(), "torch": torch.__version__,
               "command": " ".join(["python", "benchmarks/throughput/e2e_decode.py", *(argv if argv is not None
                                                                                         else sys.argv[1:])]),
               "params": params, "copy_bandwidth_Bps": args.bandwidth, "rows": rows}
    name = f"e2e_decode_{args.preset}_{device.split(' (')[0].replace(' ', '_')}"
    path = write_json(name, payload, args.out_dir)
    print("wrote", path)
    title = f"e2e decode through Engine.generate, {args.preset} dummy weights, {device}"
    if plot(path[:-5] + ".png", title, rows):
        print("wrote", path[:-5] + ".png")
    return path


if __name__ == "__main__":
    main()
