"""End-to-end decode throughput through the offline Engine, per SpectrumKV tier budget.

`batch` requests of `context` random tokens each (dummy weights, realistic shapes) run through
`Engine.generate` only, the public entry point. Per (batch, context) point and budget, one engine:

    1. prefill: generate(max_new_tokens=1) on every prompt (timed: includes the Triton JIT)
    2. decode:  generate(max_new_tokens=n1) and generate(max_new_tokens=n2) on the same prompts,
       each `--repeats` times. The prompts are radix-cache hits by then (one token each is
       recomputed), so both calls pay the same small prefill and the decode step is
           step = (T(n2) - T(n1)) / (n2 - n1)      (fastest of the repeats, after one warm-up call)
       which takes every per-step cost the engine has (scheduling, allocation, forward,
       sampling) and nothing else. Demotion of generated tokens at b < 1 runs once 2R of them
       wait (R = --kv-decode-recent, 64), every R steps after that: the window n1..n2 includes
       it only where n2 > 2R (the default 16..80 does not; e.g. --n1 16 --n2 272 does).

Pool sizing (pool_plan.py): each budget's pool is sized from the workload, i.e. every request to
its last token at that budget's tier mix (b < 1: the tiered pool's stores from the engine's own
planner, the fp16 store holding one whole request plus every request's fp16 share and decode
window). A point whose weights + pool + headroom exceed the device's free memory is skipped and
recorded with the bytes it needs; a budget that fits runs even where b = 1.0 does not.

--kernel-breakdown profiles one generate(n1) and one generate(n2) more (torch.profiler, CUDA-graph
replays included) and stores one decode step's device time per kernel and kernel group with its
launches (common/kernel_profile.py): what of a step the GPU computes, and in which kernels.

Roofline per step: (weight bytes one forward reads + resident KV bytes the step attends) over a
bandwidth measured in the same run, twice: torch's copy (read + write bytes / s) and SDPA's
effective read bandwidth on one decode step at the point's (batch, context) and head shape
(docs/lowbit-decode.md: the practical ceiling of a decode kernel). Resident KV bytes per token
come from the engine (/get_server_info's kv_bytes_per_token: scales included, dropped tokens not).

    python benchmarks/throughput/e2e_decode.py --preset llama-3-8b --context 16384 32768 \
        --batch 8 32 --kv-tier-budgets 1.0 0.5 0.25                   # GPU
    python benchmarks/throughput/e2e_decode.py --preset tiny --context 64 --batch 2 \
        --n1 1 --n2 2 --repeats 1 --device cpu                         # CPU smoke run
"""
from __future__ import annotations

import argparse
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
from common.bandwidth import copy_bandwidth_Bps, sdpa_decode  # noqa: E402
from common.kernel_profile import kernel_breakdown  # noqa: E402
from common.report import device_name, git_commit, triton_interpreter_for, write_json  # noqa: E402
from pool_plan import FP16_PAGE, HEADROOM_BYTES, fits, plan_pool, weight_bytes_read, weight_bytes_resident  # noqa: E402

# timed (n1, n2) pairs added, at most, while T(n2) <= T(n1): the window is inside the host's noise
EXTRA_PAIRS_FOR_NOISE = 5


def time_decode_step(generate, n1, n2, repeats):
    """generate(n) -> (seconds, cached tokens). Times `repeats` (n1, n2) pairs and returns
    (T(n1)s, T(n2)s, cached, step) with step = (min T(n2) - min T(n1)) / (n2 - n1): the min over
    repeats, as host noise only ever adds time. A window n1..n2 shorter than that noise can leave
    T(n2) <= T(n1): up to EXTRA_PAIRS_FOR_NOISE more pairs, then a clear error (no negative step)."""
    t1, t2, cached = [], [], []

    def time_pair():
        for n, ts in ((n1, t1), (n2, t2)):
            s, c = generate(n)
            ts.append(s)
            cached.append(c)
    for _ in range(repeats):
        time_pair()
    for _ in range(EXTRA_PAIRS_FOR_NOISE):
        if min(t2) > min(t1):
            break
        time_pair()
    if min(t2) <= min(t1):
        raise RuntimeError(f"T(n2) <= T(n1) after {len(t1)} timed pairs: the decode window {n1}..{n2} is shorter "
                           f"than the timing noise; raise --n2")
    return t1, t2, cached, (min(t2) - min(t1)) / (n2 - n1)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def engine_kwargs(args, plan: dict, budget: float, backend: str, batch: int) -> dict:
    kw = dict(load_format="dummy", dtype=args.dtype, device=args.device, attention_backend=backend,
              max_running_requests=batch, max_total_tokens=plan["pool_tokens"], chunked_prefill_size=args.chunk,
              max_prefill_tokens=args.chunk)
    if args.context_length:
        kw["context_length"] = args.context_length
    if getattr(args, "disable_overlap_schedule", False):  # the serialized baseline of overlapped decode
        kw["disable_overlap_schedule"] = True
    if args.device != "cpu":
        # what others use now + the weights + the pool (+1 GiB), as a fraction: the pool is then
        # exactly max_total_tokens (engine/memory.py caps it there)
        free, total = torch.cuda.mem_get_info()
        need = total - free + plan["weight_bytes"] + plan["kv_pool_bytes"] + 2**30
        kw["mem_fraction_static"] = min(0.97, need / total)
    if budget < 1.0:
        # the policy at the budget; int4 forced on (the probe decides int4 for real models only)
        kw.update(kv_tier_budget=budget, kv_tier_policy=args.kv_tier_policy, kv_int4="on")
        if "kv_tier_staging" in plan:  # the staging share the plan sized the stores with
            kw["kv_tier_staging"] = plan["kv_tier_staging"]
        if args.kv_tier_page_size:
            kw["kv_tier_page_size"] = args.kv_tier_page_size
    return kw


def served_attention(args, arch, budget: float, backend: str) -> tuple[int | None, dict | None]:
    """(int page, record) of a tiered triton engine: the page is --kv-tier-page-size, else the one
    the served decode config was timed at (kernels/tiered_pool_decode.SERVED_INT_PAGE; a config
    from the table only), else the engine's default (None). The record is what the engine's
    backend serves, worked out by the same function (served_config) under the same
    SGL_KVXFER_TIERED_DECODE_CONFIG in the process that starts the engine: config fields, its
    source and the int page. Other engines: (--kv-tier-page-size, None)."""
    if budget >= 1.0 or backend != "triton":
        return args.kv_tier_page_size, None
    from sgl_kvxfer import env
    from sgl_kvxfer.config import EngineConfig
    from sgl_kvxfer.kernels.tiered_pool_decode import describe_served, served_int_page

    group = arch.num_attention_heads // arch.num_key_value_heads
    rec = describe_served(arch.head_dim, group, env.TIERED_DECODE_CONFIG.get())
    # the tuned page goes with the tuned config only (an override or the interpreter: the engine's)
    page = args.kv_tier_page_size or (served_int_page(arch.head_dim, group) if rec["source"] == "table" else None)
    rec["int_page"] = page or EngineConfig().kv_tier_page_size
    rec["int_page_source"] = ("--kv-tier-page-size" if args.kv_tier_page_size else
                              "SERVED_INT_PAGE" if page else "EngineConfig default")
    return page, rec


def timed_generate(engine, prompts, n: int) -> tuple[float, int]:
    """(seconds, fewest prompt tokens any request found cached)."""
    params = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    sync()
    t = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    sync()
    elapsed = time.perf_counter() - t
    assert all(o["meta_info"]["completion_tokens"] == n for o in outs)
    return elapsed, min(int(o["meta_info"].get("cached_tokens", 0)) for o in outs)


class StepBreakdown:
    """One extra generate(n2), every decode forward and every tiering hook synchronized and timed:
    how a step splits into model forward (graph replay or eager), SpectrumKV bookkeeping (decode
    demotion: importance, retier) and the rest of the host loop. Syncs cost a little and make
    overlapped decode steps run one after another (each forward ends synchronized before the
    previous step is applied), so this run is not the throughput number; its forward and hook
    times per step stay each part's own."""

    def __init__(self, engine):
        self.runner, self.tiering = engine.runner, getattr(engine.scheduler, "tiering", None)
        self.fwd_s = {"decode": 0.0, "extend": 0.0}
        self.steps = {"decode": 0, "extend": 0}
        self.tier_s = 0.0

    def __enter__(self):
        self._forward = self.runner.forward

        def forward(batch):
            sync()
            t = time.perf_counter()
            out = self._forward(batch)
            sync()
            mode = "decode" if batch.mode.name == "DECODE" else "extend"
            self.fwd_s[mode] += time.perf_counter() - t
            self.steps[mode] += 1
            return out

        self.runner.forward = forward
        if self.tiering is not None:
            self._after = self.tiering.after_forward

            def after_forward(*a, **kw):
                sync()
                t = time.perf_counter()
                out = self._after(*a, **kw)
                sync()
                self.tier_s += time.perf_counter() - t
                return out

            self.tiering.after_forward = after_forward
        graphs = self.runner.graph_runner
        self._replays = graphs.replays if graphs is not None else None
        return self

    def __exit__(self, *exc):
        self.runner.forward = self._forward
        if self.tiering is not None:
            self.tiering.after_forward = self._after

    def result(self, wall_s: float) -> dict:
        graphs = self.runner.graph_runner
        n = max(1, self.steps["decode"])
        return {"wall_s": wall_s, "decode_steps": self.steps["decode"],
                "decode_forward_ms_per_step": 1e3 * self.fwd_s["decode"] / n,
                "extend_forward_s": self.fwd_s["extend"],
                "tiering_hooks_s": self.tier_s,
                "graph_replays": None if graphs is None else graphs.replays - self._replays,
                "cuda_graphs": graphs is not None}


def run_engine(args, model_dir: str, preset: dict, context: int, batch: int, budget: float, backend: str,
               plan: dict) -> dict:
    from sgl_kvxfer import Engine

    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, preset["vocab_size"]) for _ in range(context)] for _ in range(batch)]
    kw = engine_kwargs(args, plan, budget, backend, batch)
    t0 = time.time()
    engine = Engine(model_dir, **kw)
    try:
        start_s = time.time() - t0
        # the engine's request bound: the pool (b = 1) or its fp16 store (tiered); smaller than
        # planned means the memory fraction did not give the pool it asked for
        held, want = engine.get_server_info()["max_total_num_tokens"], plan["request_bound"]
        if held < want:
            raise RuntimeError(f"the engine's pool bounds a request at {held} tokens, the workload's plan at {want}: "
                               f"engine_kwargs {kw}")
        prefill_s, _ = timed_generate(engine, prompts, 1)
        timed_generate(engine, prompts, args.n1)  # warm-up: the first decode calls JIT-compile and plan
        t1, t2, cached, step = time_decode_step(lambda n: timed_generate(engine, prompts, n), args.n1, args.n2,
                                                args.repeats)
        info = engine.get_server_info()
        breakdown = None
        if args.breakdown:
            with StepBreakdown(engine) as bd:
                wall, _ = timed_generate(engine, prompts, args.n2)
            breakdown = bd.result(wall)
        kernels, interrupted = None, False
        if args.kernel_breakdown:
            try:
                kernels = kernel_breakdown(lambda n: timed_generate(engine, prompts, n), args.n1, args.n2,
                                           torch.cuda.is_available() and args.device != "cpu", top=args.kernel_top)
            except KeyboardInterrupt:  # the point's timing is complete: keep it, mark the profile missing
                kernels, interrupted = {"error": "interrupted (SIGINT) during the kernel profile"}, True
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    per_token = float(info["kv_bytes_per_token"])
    kv_tokens = batch * (context + (args.n1 + args.n2) // 2)  # what a timed step attends, on average
    return {"engine_kwargs": kw, "engine_start_s": start_s, "prefill_s": prefill_s,
            "prefill_tok_s": batch * context / prefill_s, "generate_s": {"n1": t1, "n2": t2},
            "cached_tokens_min": min(cached),
            # a paged pool matches whole pages and recomputes the last token: up to a page is recomputed
            "all_prompts_cached": min(cached) >= context - FP16_PAGE,
            "decode_step_s": step, "decode_tok_s": batch / step,
            "kv_bytes_per_token": per_token, "kv_full_bytes_per_token": plan["kv_full_bytes_per_token"],
            "kv_fraction_of_fp16": per_token / plan["kv_full_bytes_per_token"],
            "kv_tokens_per_step": kv_tokens, "kv_resident_bytes": per_token * kv_tokens,
            "max_total_num_tokens": info.get("max_total_num_tokens"), "breakdown": breakdown,
            "kernels": kernels, "interrupted": interrupted}


def roofline(row: dict, bandwidths: dict) -> None:
    """Weights + KV bytes of one step over each bandwidth, and the measured step's share, in place."""
    step_bytes = row["weight_bytes_read_per_step"] + row["kv_resident_bytes"]
    row["step_bytes"] = step_bytes
    for name, bw in bandwidths.items():
        if bw:
            row[f"roofline_step_s_{name}"] = step_bytes / bw
            row[f"fraction_of_roofline_{name}"] = step_bytes / bw / row["decode_step_s"]


def summary(rows: list[dict]) -> str:
    """A markdown table of the rows (skipped and failed points included)."""
    out = ["| batch | context | b | decode tok/s | step ms | KV B/token (of fp16) | roofline ms copy / SDPA | "
           "% of roofline copy / SDPA |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['batch']} | {r['context']} | {r['kv_tier_budget']:g} |"
        if "decode_tok_s" not in r:
            why = r.get("skipped") or r.get("error", "")
            out.append(f"{head} {'skipped' if 'skipped' in r else 'error'}: {why[:120]} | | | | |")
            continue
        roof = " / ".join(f"{r[f'roofline_step_s_{k}'] * 1e3:.2f}" if f"roofline_step_s_{k}" in r else "-"
                          for k in ("copy", "sdpa"))
        frac = " / ".join(f"{r[f'fraction_of_roofline_{k}']:.0%}" if f"fraction_of_roofline_{k}" in r else "-"
                          for k in ("copy", "sdpa"))
        out.append(f"{head} {r['decode_tok_s']:.1f} | {r['decode_step_s'] * 1e3:.2f} | {r['kv_bytes_per_token']:.0f} "
                   f"({r['kv_fraction_of_fp16']:.3f}) | {roof} | {frac} |")
    return "\n".join(out)


def plot(path_png: str, title: str, rows: list[dict]) -> bool:
    """Decode tok/s per (batch, context) and budget | fraction of the SDPA-bandwidth roofline."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ran = [r for r in rows if "decode_tok_s" in r]
    if not ran:
        return False
    shapes = sorted({(r["batch"], r["context"]) for r in rows})
    series = sorted({(r["kv_tier_budget"], r["backend"]) for r in rows}, reverse=True)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    width = 0.8 / max(1, len(series))
    for i, (budget, backend) in enumerate(series):
        pick = {(r["batch"], r["context"]): r for r in ran if (r["kv_tier_budget"], r["backend"]) == (budget, backend)}
        xs = [x + i * width for x in range(len(shapes))]
        label = f"b={budget:g} {backend}"
        axes[0].bar(xs, [pick[s]["decode_tok_s"] if s in pick else 0 for s in shapes], width, label=label)
        axes[1].bar(xs, [pick[s].get("fraction_of_roofline_sdpa", pick[s].get("fraction_of_roofline_copy", 0))
                         if s in pick else 0 for s in shapes], width, label=label)
    ticks = [x + width * (len(series) - 1) / 2 for x in range(len(shapes))]
    for ax, ylabel in zip(axes, ("decode tok/s (batch / step)  [0 = skipped]",
                                 "weights+KV roofline (SDPA read bw) / step")):
        ax.set_xticks(ticks, [f"batch {b}\nctx {c}" for b, c in shapes])
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path_png, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="llama-3-8b")
    p.add_argument("--context", type=int, nargs="+", default=[16384, 32768])
    p.add_argument("--batch", type=int, nargs="+", default=[8, 32], help="run batch-major: all contexts of "
                   "the first batch first")
    p.add_argument("--kv-tier-budgets", type=float, nargs="+", default=[1.0, 0.5, 0.25],
                   help="one engine per budget; 1.0 = untiered pool, < 1 = SpectrumKV tiers")
    p.add_argument("--kv-tier-policy", default="greedy")
    p.add_argument("--kv-tier-page-size", type=int, default=None,
                   help="the int stores' page (default: the page the served tiered decode config was timed "
                   "at, kernels/tiered_pool_decode.SERVED_INT_PAGE, else the engine's)")
    p.add_argument("--backends", nargs="+", default=["triton"], help="attention backends, one engine each")
    p.add_argument("--n1", type=int, default=16, help="decode tokens of the short generate call")
    p.add_argument("--n2", type=int, default=80, help="decode tokens of the long generate call")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--chunk", type=int, default=8192, help="--chunked-prefill-size and --max-prefill-tokens")
    p.add_argument("--context-length", type=int, default=None, help="the engine's --context-length (default: "
                   "the model's); bounds the CUDA-graph decode tables")
    p.add_argument("--headroom-gib", type=float, default=HEADROOM_BYTES / 2**30,
                   help="memory kept free beside weights and pool (activations, graphs, allocator slack)")
    p.add_argument("--breakdown", action=argparse.BooleanOptionalAction, default=True,
                   help="one more generate(n2) with synchronized timers: forward ms per decode step, graph "
                   "replays, time in SpectrumKV's hooks (row['breakdown'])")
    p.add_argument("--kernel-breakdown", action="store_true",
                   help="profile generate(n1) and generate(n2) once more: one decode step's device time per "
                   "kernel and kernel group, and its launches (row['kernels'], common/kernel_profile.py)")
    p.add_argument("--kernel-top", type=int, default=16, help="kernels listed by --kernel-breakdown")
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                   help="run each engine in a child process (its GPU memory is all back when it exits, "
                   "so every point finds the card as empty as the first); default: on CUDA only")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="apply every decode step before the next launches (the engine's flag): the baseline")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--child-point", default=None, help=argparse.SUPPRESS)  # JSON: one point, in a child
    args = p.parse_args(argv)
    if args.isolate is None:
        args.isolate = args.device.startswith("cuda")
    if not all(0.0 < b <= 1.0 for b in args.kv_tier_budgets) or args.n2 <= args.n1:
        p.error("budgets must be in (0, 1] and --n2 > --n1")
    if args.kv_tier_page_size is not None and (args.kv_tier_page_size < 16 or args.kv_tier_page_size & (
            args.kv_tier_page_size - 1)):
        p.error("--kv-tier-page-size must be a power of two >= 16")
    triton_interpreter_for(args.device)  # a CPU run's triton backend runs in Triton's interpreter
    signal.signal(signal.SIGINT, signal.default_int_handler)  # `timeout -s INT`: keep what ran

    from sgl_kvxfer.models.arch_config import ModelArchConfig
    from sgl_kvxfer.models.presets import PRESETS, write_dummy_tokenizer, write_preset_config

    preset = PRESETS[args.preset]
    arch = ModelArchConfig.from_hf_dict(preset)
    dtype = getattr(torch, args.dtype)
    if args.child_point:
        return run_child(args, preset, arch, dtype)
    dev = torch.device(args.device)
    device = device_name(args.device)
    copy_bw = copy_bandwidth_Bps(dev)
    print(f"{device}: copy {copy_bw / 1e9:.1f} GB/s", flush=True)
    rows, sdpa = [], {}
    name = f"e2e_decode_{args.preset}_{device.split(' (')[0].replace(' ', '_')}"
    params = vars(args)

    def payload(partial: bool) -> dict:
        return {"benchmark": "e2e_decode", "device": device, "commit": git_commit(), "torch": torch.__version__,
                "params": params, "partial": partial, "copy_bandwidth_Bps": copy_bw, "sdpa_read_bandwidth": sdpa,
                "headroom_bytes": int(args.headroom_gib * 2**30), "rows": rows}

    partial = True
    try:
        with tempfile.TemporaryDirectory(prefix="e2e_decode_") as model_dir:
            write_preset_config(args.preset, model_dir)
            write_dummy_tokenizer(model_dir, preset["vocab_size"])
            for batch in args.batch:
                for context in args.context:
                    # SDPA's effective read rate on this point's decode step, while the device is empty
                    key = f"{batch}x{context}"
                    s = sdpa_decode(batch, arch.num_attention_heads, arch.num_key_value_heads, context, arch.head_dim,
                                    dtype, dev, iters=10, max_bytes=4 << 30)
                    sdpa[key] = {k: s[k] for k in ("ms", "bytes", "Bps", "backend", "copies", "graphed")}
                    print(f"batch {batch} ctx {context}: SDPA reads {s['Bps'] / 1e9:.1f} GB/s ({s['backend']})",
                          flush=True)
                    for budget in args.kv_tier_budgets:
                        for backend in args.backends:
                            bws = {"copy": copy_bw, "sdpa": s["Bps"]}
                            if args.isolate:
                                rows.append(run_isolated(args, argv, model_dir, context, batch, budget, backend, bws))
                            else:
                                rows.append(run_point(args, model_dir, preset, arch, dtype, context, batch, budget,
                                                      backend, bws))
                            write_json(name, payload(True), args.out_dir)
                            if rows[-1].get("interrupted"):  # a SIGINT the point outlived: stop after it
                                raise KeyboardInterrupt
        partial = False
    except KeyboardInterrupt:
        print("interrupted: writing the points measured so far", flush=True)
    path = write_json(name, payload(partial), args.out_dir)
    print(summary(rows))
    print("wrote", path)
    title = f"e2e decode through Engine.generate, {args.preset} dummy weights, {device}"
    if plot(path[:-5] + ".png", title, rows):
        print("wrote", path[:-5] + ".png")
    return path


# seconds a SIGINT-ed parent waits for its child to write a finished point (lowbit.sh's `timeout
# -k 20` kills both 20 s after the SIGINT)
CHILD_GRACE_S = 15


def run_isolated(args, argv, model_dir, context, batch, budget, backend, bandwidths) -> dict:
    """run_point in a child process (this script with --child-point); its row comes back as JSON."""
    import json
    import subprocess

    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        row_out = f.name
    point = {"context": context, "batch": batch, "budget": budget, "backend": backend, "bandwidths": bandwidths,
             "model_dir": model_dir, "row_out": row_out}
    cmd = [sys.executable, os.path.abspath(__file__), *(argv if argv is not None else sys.argv[1:]),
           "--child-point", json.dumps(point)]
    proc = subprocess.Popen(cmd)
    try:
        try:
            rc = proc.wait()
        except KeyboardInterrupt:
            # the child got the same SIGINT (`timeout` signals the group): one whose timing was done
            # keeps its row (kernel profile marked interrupted) and exits 0; any other stops here
            try:
                rc = proc.wait(timeout=CHILD_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise KeyboardInterrupt from None
            if rc != 0 or not os.path.getsize(row_out):
                raise
        if rc != 0:
            return {"context": context, "batch": batch, "kv_tier_budget": budget, "backend": backend,
                    "error": f"child exited {rc}"}
        with open(row_out) as f:
            return json.load(f)
    finally:
        if os.path.exists(row_out):
            os.unlink(row_out)


def run_child(args, preset, arch, dtype) -> str:
    """The child side of run_isolated: one point, its row written where the parent reads it."""
    import json

    pt = json.loads(args.child_point)
    row = run_point(args, pt["model_dir"], preset, arch, dtype, pt["context"], pt["batch"], pt["budget"],
                    pt["backend"], pt["bandwidths"])
    with open(pt["row_out"], "w") as f:
        json.dump(row, f, default=str)
    return pt["row_out"]


def run_point(args, model_dir, preset, arch, dtype, context, batch, budget, backend, bandwidths) -> dict:
    """One engine at (batch, context, budget, backend), or the record of why it did not run."""
    page, served = served_attention(args, arch, budget, backend)
    args = argparse.Namespace(**{**vars(args), "kv_tier_page_size": page})  # the pool plan and the engine
    plan = plan_pool(arch, dtype, context, batch, budget, args.n2, args.kv_tier_policy, page)
    plan["weight_bytes"] = weight_bytes_resident(arch, dtype)
    row = {"context": context, "batch": batch, "kv_tier_budget": budget, "backend": backend, "pool_plan": plan,
           "weight_bytes": plan["weight_bytes"], "weight_bytes_read_per_step": weight_bytes_read(arch, dtype)}
    if served is not None:
        row["attention_config"] = served
        print(f"ctx {context} batch {batch} b={budget:g} {backend}: tiered decode config from {served['source']}, "
              f"int page {served['int_page']} ({served['int_page_source']}), one_launch "
              f"{served['config'].get('one_launch')}", flush=True)
    ok, need, free = fits(args.device, plan, int(args.headroom_gib * 2**30))
    row.update(bytes_needed=need, bytes_free=free)
    tag = f"ctx {context} batch {batch} b={budget:g} {backend}"
    if not ok:
        row["skipped"] = (f"needs {need / 2**30:.1f} GiB (weights {plan['weight_bytes'] / 2**30:.1f} + KV pool "
                          f"{plan['kv_pool_bytes'] / 2**30:.1f} + headroom), {free / 2**30:.1f} GiB free")
        print(f"{tag}: skipped, {row['skipped']}", flush=True)
        return row
    try:
        row.update(run_engine(args, model_dir, preset, context, batch, budget, backend, plan))
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - record it, go on with the next point
        row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        print(f"{tag}: error {row['error'][:300]}", flush=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return row
    roofline(row, bandwidths)
    roof = "".join(f", {row[f'fraction_of_roofline_{k}']:.0%} of the {k} roofline" for k in bandwidths
                   if f"fraction_of_roofline_{k}" in row)
    warn = "" if row["all_prompts_cached"] else f"; WARNING: only {row['cached_tokens_min']} prompt tokens cached"
    print(f"{tag}: {row['decode_tok_s']:.1f} tok/s (step {row['decode_step_s'] * 1e3:.2f} ms{roof}); KV "
          f"{row['kv_bytes_per_token'] / 1024:.1f} KiB/token ({row['kv_fraction_of_fp16']:.3f} of fp16); "
          f"prefill {row['prefill_s']:.1f} s{warn}", flush=True)
    bd = row.get("breakdown")
    if bd:
        print(f"{tag}: breakdown over {bd['decode_steps']} decode steps: forward {bd['decode_forward_ms_per_step']:.2f} "
              f"ms/step, graph replays {bd['graph_replays']}, tiering hooks {bd['tiering_hooks_s']:.2f} s, "
              f"extend forward {bd['extend_forward_s']:.2f} s, wall {bd['wall_s']:.2f} s", flush=True)
    k = row.get("kernels")
    if k and "error" in k:
        print(f"{tag}: kernels: {k['error']}", flush=True)
    elif k:
        unit = "ms" if k["unit"] == "kernel" else "ms of CPU operators"
        groups = ", ".join(f"{g} {s * 1e3:.3f} ({k['group_launches_per_step'][g]:.0f})" for g, s in k["groups_s"].items())
        print(f"{tag}: kernels per decode step: busy {k['busy_s'] * 1e3:.3f} {unit} in {k['launches_per_step']:.0f} "
              f"launches; {groups}", flush=True)
        for t in k["top_s"]:
            print(f"{tag}:   {t['s'] * 1e6:9.1f} us  x{t['launches']:5.1f}  [{t['group']}] {t['name'][:110]}", flush=True)
    return row


if __name__ == "__main__":
    main()
