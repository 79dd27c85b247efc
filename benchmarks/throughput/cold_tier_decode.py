"""Decode cost of SpectrumKV's cold tier (`--kv-cold-tier`), through Engine.generate.

One tiered engine (dummy weights, realistic shape, --kv-cold-tier built in: host copies of the
int4 tokens, decode-query taps in the captured graphs) runs `batch` prompts of `context` tokens.
After the prefill, modes alternate within every repeat (interleaved, so drift hits all alike):

    off      the cold tier's scoring switched off (ColdTier.enabled = False): what remains of it
             is the taps' copy of q (B x Hq x D per probed layer and step)
    on@I     scoring at --kv-promote-threshold, each request's first decode step and every I
             steps after it, for each I of --intervals (the first is the engine's setting)
    forced   (--forced-threshold T) on@first interval at a threshold low enough to promote: the
             cost of promotions themselves (host gather, side-stream copy, row repair)

    step = (T(n2) - T(n1)) / (n2 - n1)     per repeat (e2e_decode.py's protocol; prompts cached)

and reports each mode's fastest step, the per-repeat spread, and the slowdown of each mode
against `off` (fastest over fastest, and the median of the per-repeat ratios), with the cold
tier's counters over the timed calls.

    python benchmarks/throughput/cold_tier_decode.py --preset llama-3-8b --context 16384 --batch 8 \\
        --kv-tier-budget 0.2                                                           # GPU
    python benchmarks/throughput/cold_tier_decode.py --preset tiny --context 128 --batch 2 --n1 2 --n2 10 \\
        --repeats 2 --device cpu --backend torch                                       # CPU smoke run
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common.report import device_name, git_commit, triton_interpreter_for, write_json  # noqa: E402
from e2e_decode import engine_kwargs, timed_generate  # noqa: E402
from pool_plan import plan_pool, weight_bytes_resident  # noqa: E402

COUNTERS = ("scoring_passes", "scored_tokens", "promotions", "promoted_tokens", "promoted_bytes_h2d", "landed",
            "repacked_tokens", "deferred", "no_room")


def set_mode(cold, mode: str, args) -> None:
    cold.enabled = mode != "off"
    cold.threshold = args.forced_threshold if mode == "forced" else args.kv_promote_threshold
    cold.interval = int(mode.split("@")[1]) if "@" in mode else args.intervals[0]


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="llama-3-8b")
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--kv-tier-budget", type=float, default=0.2)
    p.add_argument("--kv-tier-policy", default="greedy")
    p.add_argument("--kv-promote-threshold", type=float, default=0.02)
    p.add_argument("--intervals", type=int, nargs="+", default=[16], help="scoring intervals timed (on@I modes)")
    p.add_argument("--kv-promote-layers", type=int, default=2)
    p.add_argument("--kv-promote-radius", type=int, default=4)
    p.add_argument("--forced-threshold", type=float, default=None, help="add the `forced` mode at this threshold")
    p.add_argument("--backend", default="triton")
    p.add_argument("--kv-tier-page-size", type=int, default=None, help="int store page (default: the engine's)")
    p.add_argument("--n1", type=int, default=16)
    p.add_argument("--n2", type=int, default=80)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--out-dir", default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not 0 < args.kv_tier_budget < 1 or args.n2 <= args.n1 or args.repeats < 1 or min(args.intervals) < 1:
        p.error("--kv-tier-budget in (0, 1), --n2 > --n1, --repeats >= 1, --intervals >= 1")
    for t in (args.kv_promote_threshold, args.forced_threshold):
        if t is not None and not 0 < t <= 1:
            p.error("thresholds must be in (0, 1]")
    triton_interpreter_for(args.device)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # `timeout -s INT`: keep what ran

    from sgl_kvxfer import Engine
    from sgl_kvxfer.models.arch_config import ModelArchConfig
    from sgl_kvxfer.models.presets import PRESETS, write_dummy_tokenizer, write_preset_config

    preset = PRESETS[args.preset]
    arch = ModelArchConfig.from_hf_dict(preset)
    dtype = getattr(torch, args.dtype)
    device = device_name(args.device)
    modes = ["off"] + [f"on@{i}" for i in args.intervals] + (["forced"] if args.forced_threshold is not None else [])
    plan = plan_pool(arch, dtype, args.context, args.batch, args.kv_tier_budget, args.n2, args.kv_tier_policy)
    plan["weight_bytes"] = weight_bytes_resident(arch, dtype)
    name = f"cold_tier_decode_{args.preset}_{device.split(' (')[0].replace(' ', '_')}"
    result = {"benchmark": "cold_tier_decode", "device": device, "commit": git_commit(), "torch": torch.__version__,
              "params": vars(args), "pool_plan": plan, "modes": {}, "partial": True}
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, preset["vocab_size"]) for _ in range(args.context)] for _ in range(args.batch)]
    with tempfile.TemporaryDirectory(prefix="cold_tier_decode_") as model_dir:
        write_preset_config(args.preset, model_dir)
        write_dummy_tokenizer(model_dir, preset["vocab_size"])
        kw = engine_kwargs(args, plan, args.kv_tier_budget, args.backend, args.batch)
        kw.update(kv_cold_tier=True, kv_promote_threshold=args.kv_promote_threshold,
                  kv_promote_interval=args.intervals[0], kv_promote_layers=args.kv_promote_layers,
                  kv_promote_radius=args.kv_promote_radius,
                  # host copies of the int4 tokens: at b = 0.2 (0.3) 71% (92%) of the context; the
                  # store rounds its pinned buffers up to a power of two and uses all of it
                  kv_cold_tier_tokens=args.batch * args.context * 3 // 4)
        t0 = time.time()
        engine = Engine(model_dir, **kw)
        try:
            result.update(engine_kwargs=kw, engine_start_s=time.time() - t0)
            cold = engine.scheduler.tiering.cold
            set_mode(cold, "off", args)
            result["prefill_s"] = timed_generate(engine, prompts, 1)[0]
            for mode in modes:  # warm-up: JIT, plans, the first landing of anything
                set_mode(cold, mode, args)
                timed_generate(engine, prompts, args.n1)
            steps = {m: [] for m in modes}
            counters = {m: dict.fromkeys(COUNTERS, 0) for m in modes}
            try:
                for _ in range(args.repeats):
                    for mode in modes:
                        set_mode(cold, mode, args)
                        before = dict(cold.stats)
                        t1 = timed_generate(engine, prompts, args.n1)[0]
                        t2 = timed_generate(engine, prompts, args.n2)[0]
                        steps[mode].append((t2 - t1) / (args.n2 - args.n1))
                        for k in COUNTERS:
                            counters[mode][k] += cold.stats[k] - before[k]
                result["partial"] = False
            except KeyboardInterrupt:
                print("interrupted: writing the repeats measured so far", flush=True)
            info = engine.get_server_info()
            result["server_info_cold_tier"] = info["extra"].get("kv_cold_tier")
            result["kv_bytes_per_token"] = info["kv_bytes_per_token"]
            result["kv_full_bytes_per_token"] = info["extra"].get("kv_full_bytes_per_token")
        finally:
            engine.shutdown()
    n = min(len(v) for v in steps.values()) if steps else 0
    base = steps.get("off", [])[:n]
    for mode in modes:
        s = steps[mode][:n]
        if not s:
            continue
        row = {"step_s_min": min(s), "step_s_median": statistics.median(s), "step_s_max": max(s), "steps_s": s,
               "decode_tok_s": args.batch / min(s), "counters": counters[mode], "repeats": len(s)}
        if mode != "off" and base:
            ratios = [a / b - 1 for a, b in zip(s, base)]
            row.update(slowdown_min_over_min=min(s) / min(base) - 1, slowdown_ratios=ratios,
                       slowdown_median_of_ratios=statistics.median(ratios))
        result["modes"][mode] = row
        print(f"{mode:8s} step {1e3 * min(s):.2f} ms (median {1e3 * statistics.median(s):.2f}, max {1e3 * max(s):.2f}) "
              f"{row.get('slowdown_min_over_min', 0.0):+.2%} vs off; {counters[mode]}", flush=True)
    path = write_json(name, result, args.out_dir)
    print("wrote", path)
    return path


if __name__ == "__main__":
    main()
