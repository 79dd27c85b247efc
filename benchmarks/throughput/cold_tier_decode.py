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
    score@I  (--score-only) scoring every I steps (the first interval) at a threshold nothing
             reaches: the scoring passes alone, no promotion, rows never change
    uncapped@I (--uncapped) on@first interval with no cap on the tokens a pass promotes
             (--kv-promote-max-tokens 0): what the cap changes in cost and counters

    step      per repeat, the mean wall time of the generate(n2) call's scheduler steps
              [n1 - 1, n2 - 1): n2 - n1 decode steps of the steady state, a whole number of
              scoring intervals when n2 - n1 is a multiple of them; the prefill step, the first
              decode steps and the final step (the final demotion, the release) are left out.
              Each step holds one read of sampled tokens to the host (overlapped decode: step
              N + 1 launched, then N's tokens read and applied), so its wall time is the time
              between read-backs, with no added sync.
    e2e_step  (T(n2) - T(n1)) / (n2 - n1) per repeat (e2e_decode.py's protocol; prompts cached):
              kept beside it; it also carries the final step's demotion and release, which only
              the n2 call has, and any slow call start of either call.

Every timed call starts after gc.collect() (a collection that falls into a call is not counted
in one mode only), and the modes rotate their order from repeat to repeat (mode k of repeat r
runs at place (k - r) mod M), so no mode always follows the same one (its leftovers: a copy job
still running, host allocator state). The report gives each mode's median and fastest step, the
per-repeat spread, the slowdown against `off` (median over median, and the median of the paired
per-repeat ratios), the median of the pooled per-step times (`step_s_p50_steps`: an idle step),
the same for e2e_step, the graph replays per timed call, and the cold tier's counters over the
timed calls. Each timed call also records the fewest prompt tokens any
request found cached (`cached_tokens_min`: a prompt evicted from the radix cache is recomputed
inside the timed call). `repeats_requested` / `repeats_ran` say how many repeats ran; with fewer
than --repeats (budget, interrupt) or fewer than 5, `ratio_note` says the ratios are not the
>= 5-repeat number.

Breakdown (after the warm-up, before the repeats; --no-breakdown skips it): per mode one more
generate(n2) with every forward and cold-tier hook synchronized and timed (cold_tier_breakdown.py):
ms per decode step in the forward, the scoring pass, landing, the row release, decode demotion,
cache eviction and the rest of the host loop, the scoring pass's and landing's pieces (due rows,
mass, selection, cap, issue, landing rows from the host mirrors, landing plan, the repair copies' slots,
page-repair move, table write; the landing's host plan is its own part, cold_prepare), graph replays, retractions
and cached tokens. Its
syncs perturb it a little: it says where a slowdown sits, the repeats say how large it is.

The JSON is written after every phase (engine start, prefill, warm-up) and every repeat, so a run
cut short (SIGINT from a stage's `timeout -s INT`, or a crash) leaves what it measured: `phases`
(seconds per phase), `reached` (the phase it was in), `partial`. `--time-budget-s` starts each
repeat after the first only when the last repeat's time still fits in the budget (counted from
the script's start); otherwise the run ends there with `stopped: time budget`.

    python benchmarks/throughput/cold_tier_decode.py --preset llama-3-8b --context 16384 --batch 8 \\
        --kv-tier-budget 0.2                                                           # GPU
    python benchmarks/throughput/cold_tier_decode.py --preset tiny --context 128 --batch 2 --n1 2 --n2 10 \\
        --repeats 2 --device cpu --backend torch                                       # CPU smoke run
"""
from __future__ import annotations

import argparse
import faulthandler
import gc
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
from cold_tier_breakdown import HookTimer  # noqa: E402
from e2e_decode import engine_kwargs, timed_generate  # noqa: E402
from pool_plan import plan_pool, weight_bytes_resident  # noqa: E402

COUNTERS = ("scoring_passes", "scored_tokens", "promotions", "promoted_tokens", "promoted_bytes_h2d", "landed",
            "repacked_tokens", "repack_moves", "capped_tokens", "deferred", "no_room", "restored_dropped",
            "restored_dropped_bytes_h2d")


NEVER = 1.0 + 1e-6  # a threshold no probability reaches: scoring without promotions


class StepClock:
    """Wall time of each scheduler step of the calls made inside it (perf_counter around
    Scheduler.step, no sync: each decode step holds one read of tokens to the host)."""

    def __init__(self, engine):
        self.scheduler, self.ms = engine.scheduler, []

    def __enter__(self) -> "StepClock":
        real = self.real = self.scheduler.step
        ms = self.ms

        def step(*args, **kwargs):
            t = time.perf_counter()
            ran = real(*args, **kwargs)
            if ran:  # a step that ran a batch (not an idle poll)
                ms.append(time.perf_counter() - t)
            return ran
        self.scheduler.step = step
        return self

    def __exit__(self, *exc) -> None:
        del self.scheduler.step  # the class's method shows through again


def graph_replays(engine) -> int:
    graphs = engine.runner.graph_runner
    return graphs.replays if graphs is not None else 0


def timed_window(engine, prompts, n1: int, n2: int) -> tuple[float, list[float], int, int]:
    """One timed generate(n2) -> (its seconds, the wall times of its decode steps n1 - 1 .. n2 - 2
    (the call's last n2 - 1 steps that ran are its decode steps 1 .. n2 - 1, whatever prefill
    steps came before; overlapped, they are the steps that apply decode forwards 1 .. n2 - 1,
    the last of them launching nothing), fewest cached prompt tokens, graph replays in the call)."""
    gc.collect()
    replays = graph_replays(engine)
    with StepClock(engine) as clock:
        t, c = timed_generate(engine, prompts, n2)
    decode = clock.ms[len(clock.ms) - (n2 - 1):]
    return t, decode[n1 - 2:n2 - 2], c, graph_replays(engine) - replays


def set_mode(cold, mode: str, args) -> None:
    cold.enabled = mode != "off"
    cold.threshold = {"forced": args.forced_threshold, "score": NEVER}.get(mode.split("@")[0],
                                                                           args.kv_promote_threshold)
    cold.interval = int(mode.split("@")[1]) if "@" in mode else args.intervals[0]
    cold.max_tokens = 0 if mode.startswith("uncapped") else args.kv_promote_max_tokens


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
    p.add_argument("--kv-promote-drop-run", type=int, default=32)
    p.add_argument("--kv-promote-max-tokens", type=int, default=256, help="tokens one scoring pass promotes at most "
                   "(0: no cap; the engine's default)")
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
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="start a repeat after the first only if the last one's time still fits in this many seconds "
                        "from the start")
    p.add_argument("--score-only", action="store_true",
                   help="add the `score@I` mode (first interval): scoring passes at a threshold nothing reaches, so "
                        "no promotion: the scoring's own cost, apart from promotions and promoted rows")
    p.add_argument("--uncapped", action="store_true",
                   help="add the `uncapped@I` mode (first interval): on@I with --kv-promote-max-tokens 0")
    p.add_argument("--no-breakdown", dest="breakdown", action="store_false",
                   help="skip the synchronized per-part breakdown call of each mode")
    args = p.parse_args(argv)
    if (not 0 < args.kv_tier_budget < 1 or args.n1 < 2 or args.n2 <= args.n1 or args.repeats < 1
            or min(args.intervals) < 1):
        p.error("--kv-tier-budget in (0, 1), --n1 >= 2, --n2 > --n1, --repeats >= 1, --intervals >= 1")
    for t in (args.kv_promote_threshold, args.forced_threshold):
        if t is not None and not 0 < t <= 1:
            p.error("thresholds must be in (0, 1]")
    if not (0 <= args.kv_promote_max_tokens <= 1 << 20 and 0 <= args.kv_promote_drop_run <= 4096
            and 0 <= args.kv_promote_radius <= 4096):
        p.error("--kv-promote-max-tokens in [0, 2^20], --kv-promote-drop-run and --kv-promote-radius in [0, 4096]")
    if args.time_budget_s is not None and not 0 < args.time_budget_s < float("inf"):
        p.error("--time-budget-s must be a positive finite number")
    triton_interpreter_for(args.device)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # `timeout -s INT`: keep what ran
    t_start = time.time()

    from sgl_kvxfer import Engine
    from sgl_kvxfer.models.arch_config import ModelArchConfig
    from sgl_kvxfer.models.presets import PRESETS, write_dummy_tokenizer, write_preset_config

    preset = PRESETS[args.preset]
    arch = ModelArchConfig.from_hf_dict(preset)
    dtype = getattr(torch, args.dtype)
    device = device_name(args.device)
    modes = (["off"] + [f"on@{i}" for i in args.intervals] + (["forced"] if args.forced_threshold is not None else [])
             + ([f"score@{args.intervals[0]}"] if args.score_only else [])
             + ([f"uncapped@{args.intervals[0]}"] if args.uncapped else []))
    plan = plan_pool(arch, dtype, args.context, args.batch, args.kv_tier_budget, args.n2, args.kv_tier_policy)
    plan["weight_bytes"] = weight_bytes_resident(arch, dtype)
    name = f"cold_tier_decode_{args.preset}_{device.split(' (')[0].replace(' ', '_')}"
    result = {"benchmark": "cold_tier_decode", "device": device, "commit": git_commit(), "torch": torch.__version__,
              "params": vars(args), "pool_plan": plan, "modes": {}, "partial": True, "phases": {},
              "reached": "engine start", "repeats_requested": args.repeats, "repeats_ran": 0, "breakdown": {}}
    steps = {m: [] for m in modes}  # per repeat: mean of the window's step times
    e2e = {m: [] for m in modes}  # per repeat: (T(n2) - T(n1)) / (n2 - n1)
    calls = {m: [] for m in modes}  # per repeat: {"t_n1", "t_n2", "step_ms", "graph_replays", "place"}
    cached = {m: [] for m in modes}  # per timed call: the fewest prompt tokens any request found cached
    counters = {m: dict.fromkeys(COUNTERS, 0) for m in modes}

    def save(phase: str | None = None, seconds: float | None = None) -> str:
        """Record a finished phase, summarize the repeats so far and rewrite the JSON."""
        if phase is not None:
            result["phases"][phase] = seconds
            print(f"{phase}: {seconds:.1f} s (at {time.time() - t_start:.1f} s)", flush=True)
        summarize(result, steps, e2e, calls, counters, modes, args)
        for mode, row in result["modes"].items():
            row["cached_tokens_min"] = cached[mode][:row["repeats"]]
        return write_json(name, result, args.out_dir)

    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, preset["vocab_size"]) for _ in range(args.context)] for _ in range(args.batch)]
    path = save()
    with tempfile.TemporaryDirectory(prefix="cold_tier_decode_") as model_dir:
        write_preset_config(args.preset, model_dir)
        write_dummy_tokenizer(model_dir, preset["vocab_size"])
        kw = engine_kwargs(args, plan, args.kv_tier_budget, args.backend, args.batch)
        kw.update(kv_cold_tier=True, kv_promote_threshold=args.kv_promote_threshold,
                  kv_promote_interval=args.intervals[0], kv_promote_layers=args.kv_promote_layers,
                  kv_promote_radius=args.kv_promote_radius, kv_promote_drop_run=args.kv_promote_drop_run,
                  kv_promote_max_tokens=args.kv_promote_max_tokens,
                  # host copies of the int4 tokens: at b = 0.2 (0.3) 71% (92%) of the context; the
                  # store rounds its pinned buffers up to a power of two and uses all of it
                  kv_cold_tier_tokens=args.batch * args.context * 3 // 4)
        result["engine_kwargs"] = kw
        engine = None
        try:
            t0 = time.time()
            engine = Engine(model_dir, **kw)
            result["engine_start_s"] = time.time() - t0
            path = save("engine_start_s", result["engine_start_s"])
            result["reached"] = "prefill"
            cold = engine.scheduler.tiering.cold
            set_mode(cold, "off", args)
            result["prefill_s"] = timed_generate(engine, prompts, 1)[0]
            path = save("prefill_s", result["prefill_s"])
            result["reached"] = "warm-up"
            t0 = time.time()
            for mode in modes:  # warm-up: JIT, plans, the first landing of anything
                set_mode(cold, mode, args)
                timed_generate(engine, prompts, args.n1)
            warmup_s = time.time() - t0
            path = save("warmup_s", warmup_s)
            if args.breakdown:
                result["reached"] = "breakdown"
                t0 = time.time()
                for mode in modes:
                    # NOTE: a mode's breakdown takes about n2 / n1 of its warm-up call; stop before the budget
                    if args.time_budget_s is not None and time.time() - t_start > args.time_budget_s / 2:
                        result["breakdown_stopped"] = "time budget"
                        break
                    set_mode(cold, mode, args)
                    result["breakdown"][mode] = breakdown(engine, prompts, args.n2)
                    path = save()
                path = save("breakdown_s", time.time() - t0)
            result["reached"] = "repeats"
            last = 0.0  # seconds of the last repeat
            for rep in range(args.repeats):
                if rep and args.time_budget_s is not None and time.time() - t_start + last > args.time_budget_s:
                    result["stopped"] = "time budget"
                    print(f"time budget: stopping after {rep} of {args.repeats} repeats", flush=True)
                    break
                t0 = time.time()
                shift = rep % len(modes)
                for place, mode in enumerate(modes[shift:] + modes[:shift]):
                    set_mode(cold, mode, args)
                    before = dict(cold.stats)
                    gc.collect()
                    t1, c1 = timed_generate(engine, prompts, args.n1)
                    t2, window, c2, replays = timed_window(engine, prompts, args.n1, args.n2)
                    steps[mode].append(statistics.fmean(window))
                    e2e[mode].append((t2 - t1) / (args.n2 - args.n1))
                    calls[mode].append({"t_n1": t1, "t_n2": t2, "step_ms": [round(1e3 * x, 3) for x in window],
                                        "graph_replays": replays, "place": place})
                    cached[mode].append((c1, c2))
                    for k in COUNTERS:
                        counters[mode][k] += cold.stats[k] - before[k]
                last = time.time() - t0
                path = save(f"repeat_{rep}_s", last)
            else:
                result["partial"] = False
            info = engine.get_server_info()
            result["server_info_cold_tier"] = info["extra"].get("kv_cold_tier")
            result["kv_bytes_per_token"] = info["kv_bytes_per_token"]
            result["kv_full_bytes_per_token"] = info["extra"].get("kv_full_bytes_per_token")
            result["reached"] = "done"
        except KeyboardInterrupt:
            print(f"interrupted in {result['reached']}: writing what was measured", flush=True)
        finally:
            # written before the shutdown: a shutdown cut into by the interrupt may not return cleanly
            path = save()
            if engine is not None:
                engine.shutdown()
    for mode, row in result["breakdown"].items():
        parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(row["ms_per_decode_step"].items(), key=lambda kv: -kv[1]))
        print(f"{mode:8s} breakdown ms/step: {parts}; graph replays {row['graph_replays']} of "
              f"{row['decode_steps']} steps, retractions {row['retractions']}", flush=True)
        if row.get("cold_parts_ms_per_decode_step"):
            parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(row["cold_parts_ms_per_decode_step"].items(),
                                                                 key=lambda kv: -kv[1]))
            print(f"{'':8s}   cold pieces ms/step: {parts}", flush=True)
    if result.get("ratio_note"):
        print("NOTE:", result["ratio_note"], flush=True)
    for mode, row in result["modes"].items():
        print(f"{mode:8s} step median {1e3 * row['step_s_median']:.2f} ms (min {1e3 * row['step_s_min']:.2f}, "
              f"max {1e3 * row['step_s_max']:.2f}, idle step {1e3 * (row['step_s_p50_steps'] or 0):.2f}) "
              f"{row.get('slowdown_median_over_median', 0.0):+.2%} vs off (median of ratios "
              f"{row.get('slowdown_median_of_ratios', 0.0):+.2%}); e2e step median "
              f"{1e3 * row['e2e_step_s_median']:.2f} ms {row.get('e2e_slowdown_median_over_median', 0.0):+.2%}; "
              f"{row['counters']}", flush=True)
    print("wrote", path)
    return path


def breakdown(engine, prompts, n: int) -> dict:
    """One synchronized generate(n) with its time split by part (cold_tier_breakdown.py)."""
    params = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    cold = engine.scheduler.tiering.cold
    before = dict(cold.stats)
    with HookTimer(engine) as timer:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
    row = timer.result()
    meta = [o["meta_info"] for o in outs]
    row.update(cached_tokens_min=min(int(m.get("cached_tokens", 0)) for m in meta),
               retractions=sum(int(m.get("num_retractions", 0)) for m in meta),
               counters={k: cold.stats[k] - before[k] for k in COUNTERS})
    return row


def summarize(result: dict, steps: dict, e2e: dict, calls: dict, counters: dict, modes: list[str], args) -> None:
    """result["modes"] from the repeats every mode has finished (a cut repeat counts for none)."""
    n = min(len(v) for v in steps.values()) if steps else 0
    result["repeats_ran"] = n
    result["ratio_note"] = (None if n >= max(5, args.repeats) else
                            f"{n} of {args.repeats} repeats ran: the ratios are not the >= 5-repeat number")
    base, base_e2e = steps.get("off", [])[:n], e2e.get("off", [])[:n]
    result["modes"] = {}
    for mode in modes:
        s, se = steps[mode][:n], e2e[mode][:n]
        if not s:
            continue
        pooled = [x for c in calls[mode][:n] for x in c["step_ms"]]
        row = {"step_s_min": min(s), "step_s_median": statistics.median(s), "step_s_max": max(s), "steps_s": s,
               "step_s_p50_steps": 1e-3 * statistics.median(pooled) if pooled else None,
               "e2e_step_s_median": statistics.median(se), "e2e_steps_s": se,
               "decode_tok_s": args.batch / statistics.median(s), "counters": counters[mode], "repeats": len(s),
               "calls": calls[mode][:n]}
        if mode != "off" and base:
            ratios = [a / b - 1 for a, b in zip(s, base)]
            ratios_e2e = [a / b - 1 for a, b in zip(se, base_e2e)]
            row.update(slowdown_median_over_median=statistics.median(s) / statistics.median(base) - 1,
                       slowdown_min_over_min=min(s) / min(base) - 1, slowdown_ratios=ratios,
                       slowdown_median_of_ratios=statistics.median(ratios),
                       e2e_slowdown_median_over_median=statistics.median(se) / statistics.median(base_e2e) - 1,
                       e2e_slowdown_ratios=ratios_e2e)
        result["modes"][mode] = row


if __name__ == "__main__":
    faulthandler.enable()  # a native crash (e.g. in a shutdown after an interrupt) shows its stack
    main()
