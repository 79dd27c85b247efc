"""Where an offline run spends its time: prefill vs decode, model forward vs the host work around it.

Runs the offline benchmark's workload (same prompts, warm-up, flush) through the Engine once
unsynchronized (the throughput number) and once with every scheduler step and every forward
synchronized and timed (the attribution; syncs cost a little, so its total runs a bit longer).
Per phase it reports steps, tokens, forward seconds and host seconds (schedule + batch prep +
sampling + bookkeeping = step minus forward); the rest of the run (detokenization, output
assembly) is `outside_steps_s`. Decode steps are also bucketed by batch size. With
`--torch-profile` the top kernels of one prefill batch and one decode step are listed; with
`--cprofile N` the top N host functions of one more run; with `--host-breakdown` the inclusive
host time of the engine's own functions per phase in one more run (host_breakdown.py, no
profiler overhead on what it does not wrap); with `--timeline` one more unsynced
run under a CUDA-only torch.profiler: GPU busy time (union of kernel and copy intervals) per
phase against the host's wall time per phase, i.e. how long the GPU sat idle waiting for the host.

    python benchmarks/throughput/phase_profile.py --model-preset llama-3-8b --num-prompts 128
    python benchmarks/throughput/phase_profile.py --device cpu --dtype bfloat16 --num-prompts 32 --output-len 64
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.report import RESULTS_DIR, device_name, git_commit, triton_interpreter_for, write_json  # noqa: E402
from throughput.host_breakdown import step_phase  # noqa: E402
from throughput.offline import make_prompts, sync  # noqa: E402


class StepRecorder:
    """Wraps scheduler.step and runner.forward; records (mode, batch, tokens, step_s, forward_s)."""

    def __init__(self, engine, device: str):
        self.sched, self.runner, self.device = engine.scheduler, engine.runner, device
        self.rows: list[tuple[str, int, int, float, float]] = []
        self._plain_step, self._plain_forward = self.sched.step, self.runner.forward
        self._fwd: list = []

    def __enter__(self):
        def forward(batch):
            sync(self.device)
            t = time.perf_counter()
            out = self._plain_forward(batch)
            sync(self.device)
            self._fwd.append((batch.mode.name.lower(), int(batch.input_ids.numel()),
                              int(batch.req_pool_indices.numel()), time.perf_counter() - t))
            return out

        def step():
            sync(self.device)
            t = time.perf_counter()
            ran = self._plain_step()
            sync(self.device)
            if ran and self._fwd:
                mode, tokens, bs, fwd_s = self._fwd.pop()
                self.rows.append((mode, bs, tokens, time.perf_counter() - t, fwd_s))
            return ran

        self.runner.forward, self.sched.step = forward, step
        return self

    def __exit__(self, *exc):
        # the wrappers are instance attributes: dropping them exposes the class methods again
        # (assigning the saved bound methods back would hide later class-level patches)
        del self.runner.forward, self.sched.step

    def summary(self, total_s: float) -> dict:
        phases = {}
        for mode in ("extend", "decode"):
            rows = [r for r in self.rows if r[0] == mode]
            fwd = sum(r[4] for r in rows)
            step = sum(r[3] for r in rows)
            phases[mode] = {"steps": len(rows), "tokens": sum(r[2] for r in rows), "step_s": step,
                            "forward_s": fwd, "host_s": step - fwd}
        buckets = collections.defaultdict(list)
        for mode, bs, _, step_s, fwd_s in self.rows:
            if mode == "decode":
                buckets[bs].append((step_s, fwd_s))
        by_batch = {bs: {"steps": len(v), "mean_step_ms": 1e3 * sum(s for s, _ in v) / len(v),
                         "mean_forward_ms": 1e3 * sum(f for _, f in v) / len(v)}
                    for bs, v in sorted(buckets.items())}
        in_steps = sum(p["step_s"] for p in phases.values())
        return {"total_s": total_s, "phases": phases, "outside_steps_s": total_s - in_steps,
                "decode_by_batch": by_batch}


def kernel_table(engine, prompts, params, device: str, rows: int) -> dict:
    """torch.profiler over one prefill batch and one decode step: top kernels by self time."""
    from torch.profiler import ProfilerActivity, profile

    from sgl_kvxfer.message import TokenizedGenerateReq
    from sgl_kvxfer.sampling.params import SamplingParams

    sched = engine.scheduler
    sp = SamplingParams.from_dict({**params, "max_new_tokens": 4})
    for i, ids in enumerate(prompts):
        sched.handle(TokenizedGenerateReq(rid=f"prof{i}", input_ids=ids, sampling=sp))
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    sort = "self_cuda_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    tables = {}
    for phase in ("extend", "decode"):
        if phase == "decode":
            while sched.waiting or sched.chunked:
                sched.step()
        with profile(activities=acts) as prof:
            sched.step()
            sync(device)
        tables[phase] = prof.key_averages().table(sort_by=sort, row_limit=rows)
        print(f"--- top kernels, one {phase} step ---\n{tables[phase]}", flush=True)
    while sched.has_work():
        sched.step()
    sched.take_outputs()
    engine.flush_cache()
    return tables


def host_profile(timed_run, rows: int) -> str:
    """One more unsynced run under cProfile: where the host's time goes (Python and the
    dispatch of every torch op), top `rows` functions by own time."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    timed_run()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(rows)
    print(f"--- cProfile, one run ---\n{text.getvalue()}", flush=True)
    return text.getvalue()


class StepMarks:
    """Wraps scheduler.step without syncs; records (mode, start, end) perf_counter times per
    step. Mode: "extend" when something waits to prefill, else "decode"."""

    def __init__(self, sched):
        self.sched, self.marks = sched, []
        self._plain = sched.step

    def __enter__(self):
        sched, plain = self.sched, self._plain

        def step():
            mode = step_phase(sched)
            t = time.perf_counter()
            ran = plain()
            self.marks.append((mode, t, time.perf_counter()))
            return ran

        sched.step = step
        return self

    def __exit__(self, *exc):
        del self.sched.step

    def phase_totals(self) -> tuple[dict, collections.Counter]:
        """Seconds and step counts per mode."""
        secs, steps = collections.defaultdict(float), collections.Counter()
        for mode, a, b in self.marks:
            secs[mode] += b - a
            steps[mode] += 1
        return secs, steps


def gpu_timeline(engine, timed_run) -> dict:
    """One more unsynced run: the host's wall time per phase (perf_counter around each
    scheduler step, no syncs) and the GPU's busy time per phase (CUDA-only torch.profiler).
    The GPU phases split at the first decode-attention kernel; the host phases at the first
    decode step (the workload prefills everything first, so both splits are one boundary)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with StepMarks(engine.scheduler) as rec, profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        wall_s, _ = timed_run()
    marks = rec.marks
    spans = sorted((e.start_ns() / 1e3, (e.start_ns() + e.duration_ns()) / 1e3, e.name())  # us
                   for e in prof.profiler.kineto_results.events() if e.device_type() == DeviceType.CUDA)
    split = next((a for a, _, n in spans if "decode" in n and "kernel" in n), spans[-1][1] if spans else 0)

    def busy(lo, hi) -> float:  # union of [start, end) clipped to [lo, hi), in seconds
        total, cur_a, cur_b = 0.0, None, None
        for a, b, _ in spans:
            a, b = max(a, lo), min(b, hi)
            if b <= a:
                continue
            if cur_b is None or a > cur_b:
                total += (cur_b - cur_a) if cur_b is not None else 0.0
                cur_a, cur_b = a, b
            else:
                cur_b = max(cur_b, b)
        total += (cur_b - cur_a) if cur_b is not None else 0.0
        return total / 1e6

    first_decode = next((t for m, t, _ in marks if m == "decode"), marks[-1][2] if marks else t0)
    host = {"before_first_step_s": (marks[0][1] - t0) if marks else 0.0,
            "extend_phase_s": first_decode - (marks[0][1] if marks else t0),
            "decode_phase_s": (marks[-1][2] - first_decode) if marks else 0.0}
    host["after_last_step_s"] = wall_s - sum(host.values())
    end = spans[-1][1] if spans else 0
    gpu = {"extend_busy_s": busy(spans[0][0] if spans else 0, split), "decode_busy_s": busy(split, end),
           "kernels_and_copies": len(spans),
           "extend_ops": sum(1 for a, _, _ in spans if a < split)}
    out = {"wall_s": wall_s, "host_wall": host, "gpu": gpu}
    print(f"timeline: wall {wall_s:.3f} s | host: extend phase {host['extend_phase_s']:.3f} s, decode phase "
          f"{host['decode_phase_s']:.3f} s, outside {host['before_first_step_s'] + host['after_last_step_s']:.3f} s"
          f" | GPU busy: extend {gpu['extend_busy_s']:.3f} s, decode {gpu['decode_busy_s']:.3f} s "
          f"({gpu['kernels_and_copies']} kernels/copies)", flush=True)
    return out


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The offline workload and engine flags (shared with host_breakdown.py)."""
    p.add_argument("--model-path", default=None)
    p.add_argument("--model-preset", default=None, help="a models/presets.py config (e.g. llama-3-8b, tiny), dummy weights")
    p.add_argument("--tokenizer-path", default=None,
                   help="tokenizer dir (default: the model dir's, else the embedded SmolLM2 one)")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len-min", type=int, default=128)
    p.add_argument("--input-len-max", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--max-total-tokens", type=int, default=None, help="KV pool size (default: memory-based)")
    p.add_argument("--chunked-prefill-size", type=int, default=None)
    p.add_argument("--max-prefill-tokens", type=int, default=None)
    p.add_argument("--enable-prefill-cuda-graph", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default=None, help="suffix for the result file name")
    p.add_argument("--out-dir", default=RESULTS_DIR, help="where the JSON goes")


class Workload:
    """The offline benchmark's prompts and an Engine for them, warmed up (JIT, autotune) and
    flushed; `timed_run()` generates every prompt once, unsynchronized, and returns
    (seconds, output tokens). Close it to shut the engine down."""

    def __init__(self, args):
        import json
        import shutil

        from sgl_kvxfer import Engine
        from sgl_kvxfer.models.loader import load_tokenizer, resolve_model_path, resolve_tokenizer_path

        self.args, self._tmp = args, None
        if args.model_preset:
            from sgl_kvxfer.models.presets import write_preset_config

            self.model_dir = self._tmp = write_preset_config(args.model_preset, tempfile.mkdtemp(prefix="preset_"))
            args.load_format = "dummy"
        else:
            self.model_dir = resolve_model_path(args.model_path)
        try:
            tokenizer = load_tokenizer(resolve_tokenizer_path(self.model_dir, args.tokenizer_path))
            with open(os.path.join(self.model_dir, "config.json")) as f:
                vocab = json.load(f)["vocab_size"]
            self.prompts = make_prompts(tokenizer, args.num_prompts, args.input_len_min, args.input_len_max,
                                        min(vocab, len(tokenizer)), args.seed)
            kwargs = dict(load_format=args.load_format, device=args.device, dtype=args.dtype,
                          tokenizer_path=args.tokenizer_path, attention_backend=args.attention_backend,
                          mem_fraction_static=args.mem_fraction_static, max_total_tokens=args.max_total_tokens,
                          chunked_prefill_size=args.chunked_prefill_size, max_prefill_tokens=args.max_prefill_tokens,
                          enable_prefill_cuda_graph=args.enable_prefill_cuda_graph)
            self.engine = Engine(self.model_dir, **{k: v for k, v in kwargs.items() if v is not None})
        finally:
            if self._tmp:  # the engine has read the preset's config
                shutil.rmtree(self._tmp, ignore_errors=True)
        self.model_name = args.model_preset or os.path.basename(self.model_dir.rstrip("/"))
        self.params = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
        self.engine.generate(input_ids=self.prompts, sampling_params={**self.params, "max_new_tokens": 4})
        self.engine.flush_cache()

    def timed_run(self) -> tuple[float, int]:
        sync(self.args.device)
        t0 = time.perf_counter()
        outs = self.engine.generate(input_ids=self.prompts, sampling_params=self.params)
        sync(self.args.device)
        self.engine.flush_cache()
        return time.perf_counter() - t0, sum(o["meta_info"]["completion_tokens"] for o in outs)

    def close(self) -> None:
        self.engine.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p)
    p.add_argument("--torch-profile", action="store_true", help="also list top kernels per phase")
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="also run the workload under cProfile and list its top N functions by own time")
    p.add_argument("--timeline", action="store_true",
                   help="also compare host wall time and GPU busy time per phase (CUDA)")
    p.add_argument("--host-breakdown", action="store_true",
                   help="also time the engine's host-side functions per phase in one more run (host_breakdown.py)")
    args = p.parse_args()
    triton_interpreter_for(args.device)

    work = Workload(args)
    engine, prompts, params, timed_run = work.engine, work.prompts, work.params, work.timed_run
    plain_s, out_tokens = timed_run()
    with StepRecorder(engine, args.device) as rec:
        synced_s, _ = timed_run()
    result = {"unsynced": {"elapsed_s": plain_s, "output_tok_s": out_tokens / plain_s},
              "synced": rec.summary(synced_s)}
    if args.torch_profile:
        result["kernel_tables"] = kernel_table(engine, prompts[:64], params, args.device, rows=25)
    if args.timeline and args.device.startswith("cuda"):
        result["timeline"] = gpu_timeline(engine, timed_run)
    if args.host_breakdown:
        from throughput.host_breakdown import HostBreakdown, format_report

        with HostBreakdown(engine.scheduler) as hb:
            hb_s, _ = timed_run()
        result["host_breakdown"] = {"wall_s": hb_s, "phases": hb.report()}
        print(f"host breakdown run: {hb_s:.3f} s\n{format_report(result['host_breakdown']['phases'])}", flush=True)
    if args.cprofile:
        result["cprofile"] = host_profile(timed_run, args.cprofile)
    print(f"unsynced: {out_tokens / plain_s:.1f} output tok/s ({plain_s:.2f} s)")
    s = result["synced"]
    for mode, ph in s["phases"].items():
        print(f"{mode:7s} steps {ph['steps']:5d} tokens {ph['tokens']:7d} forward {ph['forward_s']:.3f} s "
              f"host {ph['host_s']:.3f} s")
    print(f"outside steps {s['outside_steps_s']:.3f} s of {s['total_s']:.3f} s (synced run)")
    for bs, b in list(s["decode_by_batch"].items())[-4:]:
        print(f"decode bs {bs}: {b['steps']} steps, step {b['mean_step_ms']:.2f} ms, "
              f"forward {b['mean_forward_ms']:.2f} ms")
    name = f"phase_profile_{work.model_name}_{args.device.split(':')[0]}" + (f"_{args.tag}" if args.tag else "")
    payload = {"benchmark": "phase_profile", "device": device_name(args.device), "commit": git_commit(),
               "params": {**vars(args), "model_dir": work.model_dir,
                          "max_running_requests": engine.runner.max_running_requests,
                          "chunked_prefill_size": engine.server_args.scheduler.resolved_chunked_prefill_size},
               **result}
    work.close()
    print("wrote", write_json(name, payload, args.out_dir))


if __name__ == "__main__":
    main()
