"""Where a tiered prefill's time goes: one in-process Engine per budget, one prompt per view.

    python benchmarks/pd/tiered_prefill_profile.py [--budgets 1.0 0.3] [--preset llama-3-8b]
        [--prompt 8192] [--chunk 2048] [--device cuda] [--rank-chunks] [--out-dir DIR]

Per budget (b < 1: `--kv-tier-budget b --kv-int4 on`), an Engine on dummy weights serves `--warmup`
prompts of random ids (Triton compiles stay out), then one more prompt of `--prompt` random ids
(max_new_tokens 1, nothing cached) for each view, each view on its own prompt. With `--rank-chunks`
(b < 1) it also times prompts ranked chunk by chunk as a PD chunk stream ranks them (ChunkRanking:
each chunk's window observer and its `chunk_tiers`, no pack or wire), and the views run that way:

    timed     wall time, the tiering's own spans (EngineTiering.prefill_spans: tier_scores,
              tier_retier, tier_assign, tier_move, tier_row) and the host time of the re-tier's
              functions (_retier, allocator.retier_runs / _plan_retier / free, pool.move), unsynced;
              per prompt also the collector's runs (GCStats) and, for each re-tier, the scheduler
              thread's wall and CPU time, context switches and collections (HostClock)
    synced    the same functions timed with a device sync before and after each (their GPU work
              and the queue they wait for included), reported apart from `timed`
    sync_debug  torch.cuda.set_sync_debug_mode("warn"): every synchronizing CUDA call, grouped by
              its innermost sgl_kvxfer frames (file:line:function) with counts (CUDA only)
    cprofile  cProfile of the whole prompt: top 40 by cumulative time, top 30 by own time
    torch_profiler  CPU + CUDA activities: top 25 CUDA kernels by GPU time with counts, and the
              CUDA runtime calls made by the host (synchronizations, copies, host allocations,
              launches) with counts and total time

Each view is guarded: a failure is recorded under its name and the others still run. The JSON
(tiered_prefill_profile_<device>.json) is rewritten after every view; a text summary goes to
stdout, progress to stderr.
"""
from __future__ import annotations

import argparse
import cProfile
import collections
import functools
import gc
import io
import os
import pstats
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.report import device_name, git_commit  # noqa: E402

from sgl_kvxfer.utils.host_runtime import GCStats  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = os.path.join(REPO, "sgl_kvxfer")
RUNTIME_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync",
                 "cudaMemcpy", "cudaHostAlloc", "cudaFreeHost", "cudaMalloc", "cudaFree", "cudaLaunchKernel",
                 "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaStreamWaitEvent",
                 "cudaEventRecord", "cudaEventQuery", "cudaHostRegister", "cudaPointerGetAttributes")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Prompts:
    """Random token ids, a fresh seed per prompt: no prompt hits another's radix-cache entry."""

    def __init__(self, length: int, vocab: int, seed: int):
        self.length, self.vocab, self.rng = length, vocab, random.Random(seed)

    def next(self) -> list[int]:
        return [self.rng.randrange(100, self.vocab - 100) for _ in range(self.length)]


def generate(engine, ids: list[int], device: str) -> float:
    """Milliseconds of one prompt with one new token (synced at both ends)."""
    sync(device)
    t = time.perf_counter()
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0, "ignore_eos": True})
    sync(device)
    ms = 1e3 * (time.perf_counter() - t)
    if out["meta_info"]["completion_tokens"] != 1:
        raise RuntimeError(f"expected one new token, got {out['meta_info']}")
    return ms


def allocator_counts(device: str) -> dict:
    """The CUDA caching allocator's counters a slow step can come from: a retry (cached blocks
    released to fit an allocation) and device mallocs / frees (each can stall the host)."""
    if not device.startswith("cuda"):
        return {}
    st = torch.cuda.memory_stats()
    return {k: int(st.get(k, 0)) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free")}


# ---------------------------------------------------------------------- timers on the re-tier path
class FunctionTimers:
    """Instance-attribute wrappers over the re-tier's functions: calls and host ms per function
    (with `synced`, a device sync before and after each call, so its GPU work and the queue
    ahead of it count). The prompt's spans are copied out of EngineTiering.prefill_spans (a
    weak dict: the request object goes away after the prompt)."""

    def __init__(self, engine, device: str, synced: bool):
        sched = engine.scheduler
        self.tiering = getattr(sched, "tiering", None)
        self.device, self.synced = device, synced
        self.stats: dict[str, list[float]] = collections.defaultdict(list)
        self.spans: list[list] = []
        self.gc = GCStats()  # the whole prompt's collections
        self.retier_host: list[dict] = []  # per _tier_prefill call: HostClock.since
        self.targets = []
        if self.tiering is not None:
            alloc, pool = self.tiering.allocator, self.tiering.pool
            self.targets = [(self.tiering, "_tier_prefill"), (self.tiering, "_retier"), (self.tiering, "_record"),
                            (alloc, "retier_runs"), (alloc, "_plan_retier"), (alloc, "alloc_tier"), (alloc, "free"),
                            (pool, "move"), (pool, "route"), (pool, "_to_device")]

    def _wrap(self, obj, name):
        plain = getattr(obj, name)
        label = f"{type(obj).__name__}.{name}"

        @functools.wraps(plain)
        def timed(*a, **kw):
            if self.synced:
                sync(self.device)
            host0 = HostClock.now(self.gc) if name == "_tier_prefill" else None
            t = time.perf_counter()
            try:
                return plain(*a, **kw)
            finally:
                if self.synced:
                    sync(self.device)
                self.stats[label].append(1e3 * (time.perf_counter() - t))
                if host0 is not None:
                    self.retier_host.append(HostClock.since(host0, HostClock.now(self.gc)))
                if name == "_tier_prefill" and a:
                    spans = self.tiering.prefill_spans.get(a[0])
                    if spans:
                        t0 = min(s[1] for s in spans)
                        self.spans.append([(n, 1e3 * (s - t0), 1e3 * (e - s)) for n, s, e in spans])

        return timed

    def __enter__(self):
        for obj, name in self.targets:
            if hasattr(obj, name):
                setattr(obj, name, self._wrap(obj, name))
        return self

    def __exit__(self, *exc):
        self.gc.close()
        for obj, name in self.targets:
            if name in vars(obj):  # the wrapper is an instance attribute: the method shows again
                delattr(obj, name)

    def result(self) -> dict:
        return {"functions": {k: {"calls": len(v), "total_ms": sum(v), "max_ms": max(v)}
                              for k, v in self.stats.items()},
                "spans_ms": self.spans, "gc": self.gc.snapshot(), "retier_host": self.retier_host}


class HostClock:
    """What the scheduler thread went through in a stretch: wall and its own CPU time (wall far
    above CPU: it waited, on the GIL, a device sync or the OS), its voluntary / involuntary
    context switches (involuntary: the OS preempted it), the collections inside and its minor
    page faults (first touches of fresh host memory)."""

    @staticmethod
    def now(gc_stats: GCStats) -> tuple:
        ru = resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF))
        return (time.perf_counter(), time.thread_time(), ru.ru_nvcsw, ru.ru_nivcsw,
                sum(gc_stats.count), sum(gc_stats.seconds), ru.ru_minflt)

    @staticmethod
    def since(a: tuple, b: tuple) -> dict:
        return {"wall_ms": round(1e3 * (b[0] - a[0]), 3), "cpu_ms": round(1e3 * (b[1] - a[1]), 3),
                "vcsw": b[2] - a[2], "ivcsw": b[3] - a[3], "gc_collections": b[4] - a[4],
                "gc_ms": round(1e3 * (b[5] - a[5]), 3), "minor_faults": b[6] - a[6]}


# ---------------------------------------------------------------------- views
def view_timed(engine, ids, device, synced: bool) -> dict:
    with FunctionTimers(engine, device, synced) as timers:
        wall = generate(engine, ids, device)
    tiering = timers.tiering
    rec = tiering.records[-1] if tiering is not None and tiering.records else None
    return {"wall_ms": wall, **timers.result(),
            "last_record": None if rec is None else {"asked": list(rec.asked), "got": list(rec.got),
                                                     "byte_ratio": rec.byte_ratio, "tokens": rec.end - rec.start}}


def _frames(stack, depth: int = 3) -> str:
    """The innermost `depth` sgl_kvxfer frames of a stack (innermost first), else its innermost frame."""
    ours = [f for f in reversed(stack) if os.path.abspath(f.filename).startswith(PKG)]
    pick = ours[:depth] or list(reversed(stack))[:1]
    return " <- ".join(f"{os.path.relpath(f.filename, REPO)}:{f.lineno}:{f.name}" for f in pick)


def view_sync_debug(engine, ids, device) -> dict:
    if not device.startswith("cuda"):
        return {"skipped": "sync debug mode needs CUDA"}

    def run():
        torch.cuda.set_sync_debug_mode("warn")
        try:
            return generate(engine, ids, device)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    wall, sites = capture_warnings(run)
    return {"wall_ms": wall, "syncs": sum(r["count"] for r in sites), "sites": sites}


def capture_warnings(fn):
    """(fn(), [{where, count, message}]): every warning fn raises (torch's sync-debug warnings
    among them: TORCH_WARN reaches Python's warnings inside the calling frame), grouped by the
    innermost sgl_kvxfer frames of the stack that raised it, most frequent first."""
    counts: collections.Counter = collections.Counter()
    messages: dict[str, str] = {}

    def show(message, category, filename, lineno, file=None, line=None):
        where = _frames(traceback.extract_stack()[:-1])
        counts[where] += 1
        messages.setdefault(where, str(message).splitlines()[0][:200])

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        value = fn()
    return value, [{"where": w, "count": c, "message": messages[w]} for w, c in counts.most_common()]


def _stats_text(prof, sort: str, rows: int) -> str:
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats(sort).print_stats(rows)
    return text.getvalue()


def view_cprofile(engine, ids, device) -> dict:
    prof = cProfile.Profile()
    prof.enable()
    try:
        wall = generate(engine, ids, device)
    finally:
        prof.disable()
    return {"wall_ms": wall, "cumulative": _stats_text(prof, "cumulative", 40), "tottime": _stats_text(prof, "tottime", 30)}


def _device_us(e) -> float:
    for attr in ("device_time_total", "cuda_time_total"):
        if hasattr(e, attr):
            return float(getattr(e, attr))
    return 0.0


def view_torch_profiler(engine, ids, device) -> dict:
    from torch.profiler import DeviceType, ProfilerActivity, profile

    cuda = device.startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        wall = generate(engine, ids, device)
    events = prof.key_averages()
    kernels = sorted((e for e in events if getattr(e, "device_type", None) == DeviceType.CUDA),
                     key=_device_us, reverse=True) if cuda else []
    runtime = {e.key: {"count": e.count, "cpu_total_ms": e.cpu_time_total / 1e3}
               for e in events if e.key in RUNTIME_CALLS}
    cpu_ops = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:25]
    return {"wall_ms": wall, "note": None if cuda else "CPU: no CUDA activity recorded",
            "gpu_kernel_total_ms": sum(_device_us(e) for e in kernels) / 1e3,
            "top_kernels": [{"name": e.key[:120], "count": e.count, "total_ms": _device_us(e) / 1e3}
                            for e in kernels[:25]],
            "runtime_calls": runtime,
            "top_cpu_self": [{"name": e.key[:120], "count": e.count, "self_ms": e.self_cpu_time_total / 1e3}
                             for e in cpu_ops]}


class ChunkRanking:
    """What a PD prefill's tiered chunk stream adds to each prompt (disagg/prefill_chunks.py), on
    one engine: every chunk but the last is ranked by its own window queries (`rank_chunks`, the
    per-layer window observer) and tiered when its results are applied (`chunk_tiers`, which waits
    for that chunk's snapshot). The packs and the wire are not part of it. Records, per prompt,
    the host ms from the prompt's first launch at which each chunk was launched and tiered."""

    def __init__(self, engine, on: bool):
        self.tiering = getattr(engine.scheduler, "tiering", None)
        self.on = on and self.tiering is not None
        self.launched: list[float] = []
        self.tiered: list[float] = []
        self._t0 = None

    def __enter__(self):
        if not self.on:
            return self
        from sgl_kvxfer.forward_batch import ForwardMode

        tiering, plain_before, plain_after = self.tiering, self.tiering.before_forward, self.tiering.after_forward

        def before_forward(batch, fb):
            if batch.mode == ForwardMode.EXTEND:
                if self._t0 is None:
                    self._t0 = time.perf_counter()
                self.launched.append(1e3 * (time.perf_counter() - self._t0))
                for s in batch.slices:
                    if s.start == 0 and s.req not in tiering._chunk_acc:
                        tiering.rank_chunks(s.req)
            return plain_before(batch, fb)

        def after_forward(batch, chunked):
            if batch.mode == ForwardMode.EXTEND:
                for s in batch.slices:
                    end = s.start + s.length
                    if end < s.req.prompt_len and s.req in tiering._chunk_acc:  # (seq_len counts the new token)
                        tiering.chunk_tiers(s.req, s.start, end)
                        self.tiered.append(1e3 * (time.perf_counter() - self._t0))
            return plain_after(batch, chunked)

        tiering.before_forward, tiering.after_forward = before_forward, after_forward
        return self

    def __exit__(self, *exc):
        if self.on:
            for name in ("before_forward", "after_forward"):
                if name in vars(self.tiering):
                    delattr(self.tiering, name)

    def result(self) -> dict:
        return {"chunk_launch_ms": [round(x, 2) for x in self.launched],
                "chunk_tiered_ms": [round(x, 2) for x in self.tiered]} if self.on else {}


VIEWS = {"timed": lambda e, i, d: view_timed(e, i, d, synced=False),
         "synced": lambda e, i, d: view_timed(e, i, d, synced=True),
         "sync_debug": view_sync_debug, "cprofile": view_cprofile, "torch_profiler": view_torch_profiler}


# ---------------------------------------------------------------------- driver
def engine_kwargs(a, budget: float) -> dict:
    kw = dict(load_format="dummy", dtype=a.dtype, device=a.device, chunked_prefill_size=a.chunk,
              max_prefill_tokens=a.chunk, max_total_tokens=a.max_total_tokens, disable_cuda_graph=not a.cuda_graph,
              kv_tier_staging=a.kv_tier_staging, log_level="warning")
    if a.attention_backend:
        kw["attention_backend"] = a.attention_backend
    if a.mem_fraction_static is not None:
        kw["mem_fraction_static"] = a.mem_fraction_static
    if budget < 1.0:
        kw.update(kv_tier_budget=budget, kv_int4="on")
    return kw


def profile_budget(a, model_dir: str, budget: float, prompts: Prompts, out: dict, save) -> None:
    from sgl_kvxfer import Engine

    row = out["budgets"][str(budget)] = {"engine_kwargs": engine_kwargs(a, budget)}
    t0 = time.time()
    engine = Engine(model_dir, **row["engine_kwargs"])
    try:
        row["engine_start_s"] = time.time() - t0
        row["tiering"] = getattr(engine.scheduler, "tiering", None) is not None
        row["host_runtime"] = {**getattr(engine, "host_runtime", {}), "cpus": len(os.sched_getaffinity(0))}
        log(f"b={budget}: engine up in {row['engine_start_s']:.1f} s, warm-up x{a.warmup}")
        row["warmup_ms"] = [generate(engine, prompts.next(), a.device) for _ in range(a.warmup)]
        row["plain_ms"], row["plain_detail"] = [], []
        for _ in range(a.repeats):  # unsynced timers on the re-tier path: which part a slow prompt spends in
            alloc0 = allocator_counts(a.device)
            with FunctionTimers(engine, a.device, synced=False) as timers:
                row["plain_ms"].append(generate(engine, prompts.next(), a.device))
            alloc1 = allocator_counts(a.device)
            row["plain_detail"].append({"ms": row["plain_ms"][-1], **timers.result(),
                                        "allocator": {k: alloc1[k] - alloc0[k] for k in alloc0}})
        if a.rank_chunks and row["tiering"]:  # the same prompts with a PD chunk stream's ranking
            row["ranked_ms"], row["ranked_detail"] = [], []
            for _ in range(a.repeats):
                with ChunkRanking(engine, True) as ranking:
                    row["ranked_ms"].append(generate(engine, prompts.next(), a.device))
                row["ranked_detail"].append(ranking.result())
        save()
        for name in a.views:
            log(f"b={budget}: view {name}")
            try:
                with ChunkRanking(engine, a.rank_chunks):
                    row[name] = VIEWS[name](engine, prompts.next(), a.device)
            except Exception as exc:  # one view's failure keeps the others
                row[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
                log(f"b={budget}: view {name} failed: {exc}")
            save()
    finally:
        engine.shutdown()
        del engine
        gc.collect()


def summary_text(out: dict, budgets: list[float] | None = None) -> str:
    """The text summary of `budgets` (default: every budget in `out`)."""
    lines = [f"tiered prefill profile: {out['device']} commit {out['commit']} prompt {out['params']['prompt']}"]
    for b, row in out["budgets"].items():
        if budgets is not None and float(b) not in budgets:
            continue
        lines.append(f"\n=== budget {b} (tiering {'on' if row.get('tiering') else 'off'})"
                     + (f" host {row['host_runtime']}" if row.get("host_runtime") else ""))
        if "plain_ms" in row:
            p = row["plain_ms"]
            lines.append(f"plain prompts ms: {' '.join(f'{x:.1f}' for x in p)} (median {statistics.median(p):.1f})")
            for i, d in enumerate(row.get("plain_detail", [])):
                f = d.get("functions", {})
                part = " ".join(f"{k.split('.')[-1]}:{v['total_ms']:.1f}" for k, v in f.items()
                                if k.split(".")[-1] in ("_retier", "move", "free", "_plan_retier", "_record"))
                lines.append(f"  prompt {i}: {d['ms']:.1f} ms  {part}  allocator {d.get('allocator')}")
                g, hosts = d.get("gc") or {}, d.get("retier_host") or []
                host = " ".join(f"re-tier wall {h['wall_ms']:.1f} cpu {h['cpu_ms']:.1f} ms csw {h['vcsw']}/{h['ivcsw']} "
                                f"gc {h['gc_collections']} ({h['gc_ms']:.1f} ms) faults {h['minor_faults']}" for h in hosts)
                if g or host:
                    lines.append(f"    host: {host}  prompt gc {g.get('collections')} {g.get('total_ms', 0):.1f} ms")
        if row.get("ranked_ms"):
            p = row["ranked_ms"]
            lines.append(f"chunk-ranked prompts ms: {' '.join(f'{x:.1f}' for x in p)} (median {statistics.median(p):.1f};"
                         f" plain {statistics.median(row['plain_ms']):.1f})")
            for d in row.get("ranked_detail", []):
                lines.append(f"  launched {d.get('chunk_launch_ms')} tiered {d.get('chunk_tiered_ms')}")
        for view in ("timed", "synced"):
            v = row.get(view) or {}
            if "error" in v:
                lines.append(f"[{view}] error {v['error']}")
                continue
            if not v:
                continue
            lines.append(f"[{view}] wall {v['wall_ms']:.1f} ms")
            for spans in v.get("spans_ms", []):
                lines.append("  spans: " + " ".join(f"{n}:{d:.1f}" for n, _, d in spans))
            for k, f in sorted(v.get("functions", {}).items(), key=lambda kv: -kv[1]["total_ms"]):
                lines.append(f"  {k:<36} calls {f['calls']:>4} total {f['total_ms']:8.2f} ms max {f['max_ms']:8.2f}")
        v = row.get("sync_debug") or {}
        if v:
            if "sites" in v:
                lines.append(f"[sync_debug] wall {v['wall_ms']:.1f} ms, {v['syncs']} synchronizing calls")
                lines += [f"  {s['count']:>5}  {s['where']}" for s in v["sites"][:40]]
            else:
                lines.append(f"[sync_debug] {v.get('skipped') or v.get('error')}")
        v = row.get("torch_profiler") or {}
        if "wall_ms" in v:
            lines.append(f"[torch_profiler] wall {v['wall_ms']:.1f} ms, GPU kernels {v['gpu_kernel_total_ms']:.1f} ms"
                         + (f" ({v['note']})" if v.get("note") else ""))
            lines += [f"  {k['total_ms']:8.2f} ms x{k['count']:<5} {k['name']}" for k in v["top_kernels"]]
            lines += [f"  runtime {n}: x{r['count']} {r['cpu_total_ms']:.2f} ms" for n, r in v["runtime_calls"].items()]
        elif v:
            lines.append(f"[torch_profiler] {v.get('error')}")
        v = row.get("cprofile") or {}
        if "tottime" in v:
            lines.append(f"[cprofile] wall {v['wall_ms']:.1f} ms; top by own time:")
            body = v["tottime"].split("\n")
            start = next((i for i, ln in enumerate(body) if "ncalls" in ln), 0)
            lines += ["  " + ln for ln in body[start:start + 20] if ln.strip()]
        elif v:
            lines.append(f"[cprofile] {v.get('error')}")
    base = (out["budgets"].get("1.0") or {}).get("plain_ms")
    for b, row in out["budgets"].items():
        if b != "1.0" and base and row.get("plain_ms"):
            med = statistics.median(row["plain_ms"]) / statistics.median(base)
            lines.append(f"plain prompt median b={b} / b=1.0: {med:.3f} (this run, {len(base)} and "
                         f"{len(row['plain_ms'])} prompts)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", type=float, nargs="+", default=[1.0, 0.3])
    ap.add_argument("--preset", default="llama-3-8b", help="models/presets.py config, dummy weights")
    ap.add_argument("--prompt", type=int, default=8192, help="prompt length (tokens)")
    ap.add_argument("--chunk", type=int, default=2048, help="chunked prefill size")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up prompts per budget")
    ap.add_argument("--repeats", type=int, default=5, help="plain timed prompts per budget before the views")
    ap.add_argument("--views", nargs="+", default=list(VIEWS), choices=list(VIEWS))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--attention-backend", default="triton")
    ap.add_argument("--max-total-tokens", type=int, default=40000)
    ap.add_argument("--mem-fraction-static", type=float, default=None)
    ap.add_argument("--kv-tier-staging", type=float, default=0.4)
    ap.add_argument("--cuda-graph", action="store_true",
                    help="capture decode CUDA graphs as a server does (their memory is not free for the prefill)")
    ap.add_argument("--rank-chunks", action="store_true",
                    help="b < 1: also time prompts ranked chunk by chunk as a PD chunk stream ranks them "
                         "(ChunkRanking), and run the views that way")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default=".")
    ap.add_argument("--merge", action="store_true",
                    help="keep the budgets of an existing JSON of the same name (one process per budget)")
    a = ap.parse_args(argv)
    for b in a.budgets:
        if not 0 < b <= 1:
            ap.error(f"--budgets must be in (0, 1], got {b}")
    if a.prompt < 1 or a.chunk < 1 or a.warmup < 0 or a.repeats < 1:
        ap.error("--prompt / --chunk / --repeats must be >= 1, --warmup >= 0")
    if a.prompt + 16 > a.max_total_tokens:
        ap.error("--max-total-tokens must exceed --prompt")
    if a.device == "cpu" and a.attention_backend == "triton":
        a.attention_backend = None  # the engine's CPU default
    from sgl_kvxfer.models.presets import PRESETS, write_dummy_tokenizer, write_preset_config

    if a.preset not in PRESETS:
        ap.error(f"--preset must be one of {sorted(PRESETS)}")
    vocab = PRESETS[a.preset]["vocab_size"]
    dev = device_name(a.device)
    tag = "".join(c if c.isalnum() else "_" for c in dev.split(" (")[0])
    path = os.path.join(a.out_dir, f"tiered_prefill_profile_{tag}.json")
    out = {"device": dev, "commit": git_commit(), "command": " ".join(["python", "benchmarks/pd/tiered_prefill_profile.py",
                                                                        *(argv if argv is not None else sys.argv[1:])]),
           "params": {k: v for k, v in vars(a).items() if k != "out_dir"}, "budgets": {}}

    def save() -> None:
        import json

        os.makedirs(a.out_dir, exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(out, f, indent=1, default=str)
        os.replace(path + ".tmp", path)

    if a.merge and os.path.exists(path):
        import json

        with open(path) as f:
            old = json.load(f)
        out["budgets"] = {k: v for k, v in old.get("budgets", {}).items() if float(k) not in a.budgets}
        out["command"] = "; ".join(x for x in (old.get("command"), out["command"]) if x)
    model_dir = tempfile.mkdtemp(prefix="tpp_model_")
    try:
        write_dummy_tokenizer(write_preset_config(a.preset, model_dir), vocab)
        prompts = Prompts(a.prompt, vocab, a.seed)
        for b in a.budgets:
            try:
                profile_budget(a, model_dir, b, prompts, out, save)
            except KeyboardInterrupt:
                out["interrupted"] = f"during budget {b}"
                log(f"interrupted during budget {b}")
                break
            except Exception as exc:
                out["budgets"].setdefault(str(b), {})["error"] = f"{type(exc).__name__}: {exc}"
                out["budgets"][str(b)]["traceback"] = traceback.format_exc()[-3000:]
                log(f"b={b} failed: {exc}")
            save()
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
        save()
        print(summary_text(out, a.budgets), flush=True)
        log(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
