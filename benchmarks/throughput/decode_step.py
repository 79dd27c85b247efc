"""Decode step time with CUDA graphs on vs off (--disable-cuda-graph), dummy weights.

For each preset and mode an Engine is built (triton backend, paged pool); for each batch size,
`batch` requests of `--context` random tokens go through `Engine.generate` together, each
generating `--warmup + --steps + 1` tokens. Every scheduler step and every forward is
synchronized and timed (phase_profile.StepRecorder); the timed steps are the decode steps that
carry the whole batch, after the first `--warmup` of them. Each is one full scheduler iteration
(schedule, allocate, forward, sample, and with the overlap scheduler the previous step's
results); the forward alone is timed inside it. Medians.

    python benchmarks/throughput/decode_step.py --presets smollm2-135m llama-3-8b --batches 1 8 64
    python benchmarks/throughput/decode_step.py --device cpu --presets tiny --batches 2 \
        --context 32 --steps 2 --warmup 1                            # CPU smoke run

On CPU there are no graphs: only the graphs-off mode runs (the triton backend in Triton's
interpreter, which is slow: keep the shapes tiny).
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.report import device_name, git_commit, triton_interpreter_for, write_json  # noqa: E402


def time_batch(engine, batch: int, args, rng: random.Random) -> dict:
    """`batch` requests through Engine.generate; the median step and forward of the decode steps
    that run the whole batch, after args.warmup of them."""
    from throughput.phase_profile import StepRecorder

    runner = engine.runner
    vocab = runner.arch.vocab_size
    prompts = [[rng.randrange(10, vocab) for _ in range(args.context)] for _ in range(batch)]
    params = {"max_new_tokens": args.warmup + args.steps + 1, "temperature": 0, "ignore_eos": True}
    replays0 = runner.graph_runner.replays if runner.graph_runner is not None else 0
    with StepRecorder(engine, args.device) as rec:
        engine.generate(input_ids=prompts, sampling_params=params)
    replays = (runner.graph_runner.replays if runner.graph_runner is not None else 0) - replays0
    engine.flush_cache()
    full = [(step_s, fwd_s) for mode, bs, _, step_s, fwd_s in rec.rows if mode == "decode" and bs == batch]
    timed = full[args.warmup:]
    if len(timed) < args.steps:
        raise RuntimeError(f"batch {batch}: {len(full)} decode steps ran the whole batch, want "
                           f"{args.warmup} + {args.steps} (does the pool hold every request?)")
    return {"batch": batch, "step_ms": 1e3 * statistics.median(s for s, _ in timed),
            "forward_ms": 1e3 * statistics.median(f for _, f in timed), "timed_steps": len(timed),
            "graph_replays": replays}


def run_preset(preset: str, args) -> list[dict]:
    from sgl_kvxfer import Engine
    from sgl_kvxfer.models.presets import PRESETS, write_dummy_tokenizer, write_preset_config

    model_dir = write_preset_config(preset, tempfile.mkdtemp(prefix="decode_step_"))
    write_dummy_tokenizer(model_dir, PRESETS[preset]["vocab_size"])
    rows = []
    cuda = args.device.startswith("cuda")
    for graphs in ((True, False) if cuda else (False,)):
        kw = dict(load_format="dummy", device=args.device, dtype=args.dtype, attention_backend="triton",
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
        if cuda:
            torch.cuda.empty_cache()
    shutil.rmtree(model_dir, ignore_errors=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", nargs="+", default=["smollm2-135m", "llama-3-8b"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64])
    p.add_argument("--context", type=int, default=256, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu: graphs-off only, the triton backend in Triton's interpreter (tiny shapes)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-total-tokens", type=int, default=None, help="default: --mem-fraction-static sizing")
    p.add_argument("--context-length", type=int, default=None, help="default: the preset's")
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--out-dir", default=None, help="where the JSON goes (default benchmarks/results)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("no CUDA device: pass --device cpu (tiny shapes)")
    triton_interpreter_for(args.device)

    rows = []
    for preset in args.presets:
        rows += run_preset(preset, args)
    print("\npreset          batch   off ms    on ms  speed-up  (scheduler step; forward alone in the JSON)")
    for off in (r for r in rows if not r["cuda_graph"]):
        on = next((r for r in rows if r["cuda_graph"] and r["preset"] == off["preset"]
                   and r["batch"] == off["batch"]), None)
        on_ms = f"{on['step_ms']:8.2f} {off['step_ms'] / on['step_ms']:8.2f}x" if on else "       -         -"
        print(f"{off['preset']:14s} {off['batch']:6d} {off['step_ms']:8.2f} {on_ms}")
    device = device_name(args.device)
    name = f"decode_step_{device.split(' (')[0].replace(' ', '_')}"
    payload = {"benchmark": "decode_step", "device": device, "commit": git_commit(), "torch": torch.__version__,
               "params": vars(args), "rows": rows}
    print("wrote", write_json(name, payload, args.out_dir))


if __name__ == "__main__":
    main()
