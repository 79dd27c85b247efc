"""Where the host's time goes in an offline run, per phase, without adding any sync.

Wraps the engine's host-side entry points (scheduler steps and their parts, batch packing, KV
bookkeeping, the model runner, the attention backend, the model's layers and kernels' Python
launchers) with perf_counter accumulators, runs the workload once, and reports for each phase
(extend: something waits to prefill; decode: otherwise, as phase_profile's StepMarks) the
inclusive seconds and call count of each. Timings nest: `Scheduler.step` contains everything
under it. Kernel launchers return as soon as the launch is queued, so their time is host
dispatch cost, not GPU time; a function that waits for the GPU (`InflightBatch.token_list`)
shows that wait.

Used by phase_profile.py --host-breakdown; as a script, runs phase_profile's workload (same
flags) once more after its warm-up under the breakdown and writes the report:

    python benchmarks/throughput/host_breakdown.py --device cpu --dtype bfloat16 --num-prompts 32 --output-len 64
    python benchmarks/throughput/host_breakdown.py --model-preset tiny --device cpu --num-prompts 4 \
        --input-len-min 16 --input-len-max 32 --output-len 4          # CPU smoke run
"""
from __future__ import annotations

import argparse
import collections
import importlib
import os
import sys
import time

# (module, attribute path inside it); "Class.method" patches the class, "func" the module
# global (the name as the *calling* module sees it, for functions imported by name).
# A method is patched on the class that defines it: Scheduler's step loop, batch formation and
# output handling are its mixins (scheduler/step_loop.py, batch_formation.py, outcomes.py).
TARGETS = (
    ("sgl_kvxfer.scheduler.scheduler", "Scheduler.step"),
    ("sgl_kvxfer.scheduler.batch_formation", "BatchFormationMixin._prefill_batch"),
    ("sgl_kvxfer.scheduler.batch_formation", "BatchFormationMixin._decode_batch"),
    ("sgl_kvxfer.scheduler.step_loop", "StepLoopMixin._launch_followup"),
    ("sgl_kvxfer.scheduler.step_loop", "StepLoopMixin._apply_inflight"),
    ("sgl_kvxfer.scheduler.step_loop", "StepLoopMixin._apply_prefill"),
    ("sgl_kvxfer.scheduler.outcomes", "OutcomesMixin._after_batch"),
    ("sgl_kvxfer.scheduler.step_loop", "prepare_batch"),
    ("sgl_kvxfer.scheduler.step_loop", "prepare_decode"),
    ("sgl_kvxfer.scheduler.step_loop", "process_logits"),
    ("sgl_kvxfer.scheduler.kv_lifecycle", "KVLifecycle.alloc"),
    ("sgl_kvxfer.scheduler.kv_lifecycle", "KVLifecycle.cache"),
    ("sgl_kvxfer.scheduler.kv_lifecycle", "KVLifecycle.admit"),
    ("sgl_kvxfer.scheduler.kv_lifecycle", "KVLifecycle.make_room"),
    ("sgl_kvxfer.mem_cache.paged_allocator", "PagedTokenSlotAllocator.alloc_extend"),
    ("sgl_kvxfer.mem_cache.paged_allocator", "PagedTokenSlotAllocator.free"),
    ("sgl_kvxfer.scheduler.overlap", "InflightBatch.launch"),
    ("sgl_kvxfer.scheduler.overlap", "InflightBatch.token_list"),
    ("sgl_kvxfer.scheduler.results", "FinishChecker.check"),
    ("sgl_kvxfer.engine.model_runner", "ModelRunner.forward"),
    ("sgl_kvxfer.engine.cuda_graph_runner", "CudaGraphRunner.replay"),
    ("sgl_kvxfer.layers.attention.triton_backend", "TritonAttentionBackend.prepare_metadata"),
    ("sgl_kvxfer.layers.attention.triton_backend", "TritonAttentionBackend.forward_qkv"),
    ("sgl_kvxfer.layers.attention.triton_backend", "TritonAttentionBackend._attend"),
    ("sgl_kvxfer.models.llama", "LlamaForCausalLM.forward"),
    ("sgl_kvxfer.models.llama", "LlamaForCausalLM.compute_logits"),
    ("sgl_kvxfer.models.llama", "LlamaDecoderLayer.forward"),
    ("sgl_kvxfer.layers.fused_ops", "rmsnorm"),
    ("sgl_kvxfer.layers.fused_ops", "silu_mul"),
    ("sgl_kvxfer.kernels.rope_store", "rope_store_kv"),
    ("sgl_kvxfer.kernels.extend_attention", "extend_attention_tiered"),
    ("torch.nn.modules.linear", "Linear.forward"),
    ("sgl_kvxfer.detokenizer.incremental", "IncrementalDetokenizer.append"),
    ("sgl_kvxfer.detokenizer.incremental", "IncrementalDetokenizer.finish"),
)


def step_phase(sched) -> str:
    """The phase a scheduler step about to run belongs to: "extend" while prompts wait to be
    prefilled (or one is mid-chunk), else "decode". The offline workload prefills everything
    first, so this splits a run at one boundary."""
    return "extend" if (sched.waiting or sched.chunked) else "decode"


class HostBreakdown:
    """Context manager: patches TARGETS (those that exist) on enter, restores on exit."""

    def __init__(self, sched, targets=TARGETS):
        self.sched, self.targets = sched, targets
        self.stats: dict = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0.0]))
        self.phase = "outside"
        self._restore: list = []

    def _wrap(self, name: str, call):
        stats, perf = self.stats, time.perf_counter

        def timed(*args, **kwargs):
            t = perf()
            try:
                return call(*args, **kwargs)
            finally:
                row = stats[self.phase][name]
                row[0] += 1
                row[1] += perf() - t
        return timed

    def __enter__(self):
        for mod_name, path in self.targets:
            try:
                owner = importlib.import_module(mod_name)
            except ImportError:
                continue
            *parents, attr = path.split(".")
            for p in parents:
                owner = getattr(owner, p, None)
            if owner is None or attr not in vars(owner):
                continue
            raw = vars(owner)[attr]
            if isinstance(raw, classmethod):
                new = staticmethod(self._wrap(path, getattr(owner, attr)))
            elif isinstance(raw, staticmethod):
                new = staticmethod(self._wrap(path, raw.__func__))
            else:
                new = self._wrap(path, raw)
            setattr(owner, attr, new)
            self._restore.append((owner, attr, raw))
        sched = self.sched
        plain = type(sched).step.__get__(sched)  # the (patched) class method; an instance attribute sets the phase

        def step():
            self.phase = step_phase(sched)
            try:
                return plain()
            finally:
                self.phase = "outside"
        sched.step = step
        self._restore.append((sched, "step", None))
        return self

    def __exit__(self, *exc):
        for owner, attr, raw in reversed(self._restore):
            if raw is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, raw)
        self._restore.clear()

    def report(self) -> dict:
        """{phase: [{name, calls, total_ms, per_call_us}], sorted by total}"""
        out = {}
        for phase, rows in self.stats.items():
            out[phase] = sorted(({"name": n, "calls": c, "total_ms": 1e3 * s, "per_call_us": 1e6 * s / max(c, 1)}
                                 for n, (c, s) in rows.items()), key=lambda r: -r["total_ms"])
        return out


def format_report(report: dict) -> str:
    lines = []
    for phase in ("extend", "decode", "outside"):
        if phase not in report:
            continue
        lines.append(f"--- host time, {phase} phase (inclusive; nested rows overlap) ---")
        for r in report[phase]:
            lines.append(f"{r['total_ms']:9.2f} ms {r['calls']:7d} calls {r['per_call_us']:9.1f} us/call  {r['name']}")
    return "\n".join(lines)


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from common.report import device_name, triton_interpreter_for, write_json
    from throughput.phase_profile import Workload, add_workload_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p)
    args = p.parse_args()
    triton_interpreter_for(args.device)
    work = Workload(args)
    with HostBreakdown(work.engine.scheduler) as hb:
        wall_s, out_tokens = work.timed_run()
    report = hb.report()
    print(f"host breakdown run: {wall_s:.3f} s, {out_tokens} output tokens\n{format_report(report)}", flush=True)
    payload = {"benchmark": "host_breakdown", "device": device_name(args.device),
               "params": {**vars(args), "model_dir": work.model_dir}, "wall_s": wall_s, "output_tokens": out_tokens,
               "targets": [f"{mod}.{path}" for mod, path in TARGETS], "phases": report}
    work.close()
    name = f"host_breakdown_{work.model_name}_{args.device.split(':')[0]}" + (f"_{args.tag}" if args.tag else "")
    print("wrote", write_json(name, payload, args.out_dir))


if __name__ == "__main__":
    main()
