"""Decode step time with CUDA graphs on vs off (--disable-cuda-graph), dummy weights, GPU.

For each preset and mode an Engine is built (triton backend, paged pool); for each batch size,
`batch` requests of `--context` random tokens are prefilled, then every request decodes together.
Each timed step is one full scheduler iteration (schedule, allocate, forward, sample),
synchronized; the forward alone is timed inside it (synchronized before and after). Medians.

    python benchmarks/throughput/decode_step.py --presets smollm2-135m llama-3-8b --batches 1 8 64
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


def _timed(fn, times: list[float]):
    def wrapper(*a, **kw):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn(*a, **kw)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        return out
    return wrapper


def time_batch(engine, batch: int, args, rng: random.Random) -> dict:
    """Prefill `batch` requests, then time args.steps decode steps after args.warmup."""
    from sgl_kvxfer.message import TokenizedGenerateReq
    from sgl_kvxfer.sampling.params import SamplingParams

    sched, runner = engine.scheduler, engine.runner
    vocab = runner.arch.vocab_size
    params = SamplingParams.from_dict({"max_new_tokens": args.warmup + args.steps + 1, "temperature": 0,
                                       "ignore_eos": True})
    for i in range(batch):
        ids = [rng.randrange(10, vocab) for _ in range(args.context)]
        sched.handle(TokenizedGenerateReq(rid=f"b{batch}_{i}", input_ids=ids, sampling=params))
    while sched.waiting or sched.chunked:
        sched.step()
    assert len(sched.running) == batch, "every request must decode together"
    fwd_times, step_times = [], []
    plain_forward = runner.forward
    runner.forward = _timed(plain_forward, fwd_times)  # the scheduler calls runner.forward
    step = _timed(sched.step, step_times)
    replays0 = runner.graph_runner.replays if runner.graph_runner is not None else 0
    for _ in range(args.warmup + args.steps):
        step()
    runner.forward = plain_forward
    replays = (runner.graph_runner.replays if runner.graph_runner is not None else 0) - replays0
    while sched.has_work():
        sched.step()
    sched.take_outputs()
    engine.flush_cache()
    return {"batch": batch, "step_ms": 1e3 * statistics.median(step_times[args.warmup:]),
            "forward_ms": 1e3 * statistics.median(fwd_times[args.warmup:]), "graph_replays": replays}


def run_preset(preset: str, args) -> list[dict]:
    from sgl_kvxfer import Engine
    from sgl_kvxfer.models.presets import PRESETS, write_dummy_tokenizer, write_preset_config

    model_dir = write_preset_config(preset, tempfile.mkdtemp(prefix="decode_step_"))
    write_dummy_tokenizer(model_dir, PRESETS[preset]["vocab_size"])
    rows = []
    for graphs in (True, False):
        kw = dict(load_format="dummy", dtype=args.dtype, attention_backend="triton",
                  max_running_requests=max(args.batches), disable_cuda_graph=not graphs)
        for key in ("max_total_tokens", "context_length", "mem_fraction_static"):
            if getattr(args, key) is not None:
                kw[key] = getattr(args, key)
        t0 = time.perf_counter()
        engine = Engine(model_dir, **kw)
        init_s = time.perf_counter() - t0
        rng = random.Random(args.seed)
        for batch in args.batches:
            row = {"preset": preset, "cuda_graph": graphs, "engine_init_s": init_s,
                   **time_batch(engine, batch, args, rng)}
            rows.append(row)
            print(f"{preset:14s} batch {batch:4d} graphs {'on ' if graphs else 'off'}: step "
                  f"{row['step_ms']:7.2f} ms, forward {row['forward_ms']:7.2f} ms "
                  f"({row['graph_replays']} replays; engine init {init_s:.1f} s)", flush=True)
        engine.shutdown()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", nargs="+", default=["smollm2-135m", "llama-3-8b"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64])
    p.add_argument("--context", type=int, default=256, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-total-tokens", type=int, default=None, help="default: --mem-fraction-static sizing")
    p.add_argument("--context-length", type=int, default=None, help="default: the preset's")
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--out-dir", default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA device"

    rows = []
    for preset in args.presets:
        rows += run_preset(preset, args)
    print("\npreset          batch   off ms    on ms  speed-up  (scheduler step; forward alone in the JSON)")
    for on in (r for r in rows if r["cuda_graph"]):
        off = next(r for r in rows if not r["cuda_graph"] and r["preset"] == on["preset"]
                   and r["batch"] == on["batch"])
        print(f"{on['preset']:14s} {on['batch']:6d} {off['step_ms']:8.2f} {on['step_ms']:8.2f} "
              f"{off['step_ms'] / on['step_ms']:8.2f}x")
    name = f"decode_step_{device_name('cuda').replace(' ', '_')}"
    payload = {"device": device_name("cuda"), "commit": git_commit(), "torch": torch.__version__,
               "params": vars(args), "rows": rows}
    print("wrote", write_json(name, payload, args.out_dir))


if __name__ == "__main__":
    main()
