"""End-to-end decode throughput through the Engine's scheduler: triton vs torch attention backend.

`batch` requests of `context` distinct random tokens each (dummy weights, realistic shapes) are
prefilled once (chunked, triton backend, paged pool), then every request decodes together in
phases, one per `--backends` entry, the runner's attention backend swapped between phases (the
torch backend reads the same paged pool through get_kv). Each timed step is one full scheduler
iteration (schedule, allocate, forward, sample), synchronized. Reports the median decode step,
tokens/s (= batch / step) and the weights + KV bytes roofline at the measured copy bandwidth.
Prefill time is reported too (it includes the Triton JIT of the first chunk).

    python benchmarks/throughput/e2e_decode.py --preset llama-3-8b --context 32768 --batch 8
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


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth (read + write bytes per second) of a 1 GiB buffer."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    sync()
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    sync()
    return 2 * x.numel() * 10 / (time.perf_counter() - t0)


def decode_steps(sched, n: int) -> list[float]:
    times = []
    for _ in range(n):
        sync()
        t = time.perf_counter()
        sched.step()
        sync()
        times.append(time.perf_counter() - t)
    return times


def run(args, model_dir: str, prompts: list[list[int]]) -> dict:
    """Prefill once with the triton backend, then time decode with each backend in turn on the
    SAME requests and paged pool (the runner's backend object is swapped between phases).

    NOTE: the torch backend's own prefill at 32k is not usable: SDPA with a mask and
    enable_gqa falls back to the math kernel, [Hq, chunk, 32k] fp32 scores per call."""
    from sgl_kvxfer import Engine
    from sgl_kvxfer.layers.attention import create_attention_backend
    from sgl_kvxfer.message import TokenizedGenerateReq
    from sgl_kvxfer.sampling.params import SamplingParams

    phases = args.backends
    total = len(phases) * (args.warmup + args.steps) + 2
    pool = args.batch * (args.context + total + 2 * 64) + 1024
    engine = Engine(model_dir, load_format="dummy", dtype=args.dtype, attention_backend="triton",
                    max_total_tokens=pool, max_running_requests=args.batch,
                    chunked_prefill_size=args.chunked_prefill_size, max_prefill_tokens=args.chunked_prefill_size)
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
    out = {"page_size": runner.page_size, "dtype": str(runner.dtype), "prefill_backend": "triton",
           "prefill_s": prefill_s, "prefill_tok_s": args.batch * args.context / prefill_s,
           "weight_bytes": weight_bytes, "phases": []}
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
        out["phases"].append({
            "backend": name, "decode_step_median_s": step, "decode_step_min_s": min(times),
            "decode_tok_s": args.batch / step, "kv_tokens": ctx,
            "kv_bytes_per_step": ctx * runner.kv_pool.bytes_per_token()})
    engine.shutdown()
    del engine, runner, sched, backends
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="llama-3-8b")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--chunked-prefill-size", type=int, default=8192)
    p.add_argument("--backends", nargs="+", default=["triton", "torch", "triton"],
                   help="decode phases, in order, on the same running requests")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA device"

    from sgl_kvxfer.models.presets import PRESETS, write_dummy_tokenizer, write_preset_config

    model_dir = write_preset_config(args.preset, tempfile.mkdtemp(prefix="e2e_decode_"))
    vocab = PRESETS[args.preset]["vocab_size"]
    write_dummy_tokenizer(model_dir, vocab)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(args.context)] for _ in range(args.batch)]
    bw = copy_bandwidth()
    name = f"e2e_decode_{args.preset}_{device_name('cuda').replace(' ', '_')}"
    result = run(args, model_dir, prompts)
    for ph in result["phases"]:
        ph["roofline_step_s"] = (result["weight_bytes"] + ph["kv_bytes_per_step"]) / bw
        ph["fraction_of_roofline"] = ph["roofline_step_s"] / ph["decode_step_median_s"]
        print(f"{ph['backend']:7s}: decode {ph['decode_tok_s']:8.1f} tok/s "
              f"(step {ph['decode_step_median_s'] * 1e3:7.2f} ms, {ph['fraction_of_roofline']:.0%} of the "
              f"weights+KV roofline {ph['roofline_step_s'] * 1e3:.2f} ms)")
    print(f"prefill (triton, page {result['page_size']}): {result['prefill_s']:.1f} s, "
          f"{result['prefill_tok_s']:.0f} tok/s")
    best = {}
    for ph in result["phases"]:
        best[ph["backend"]] = max(best.get(ph["backend"], 0.0), ph["decode_tok_s"])
    if "triton" in best and "torch" in best:
        print(f"triton / torch decode speed-up: {best['triton'] / best['torch']:.2f}x")
    payload = {"device": device_name("cuda"), "commit": git_commit(), "torch": torch.__version__,
               "params": vars(args), "copy_bandwidth_Bps": bw, **result}
    print("wrote", write_json(name, payload, args.out_dir))


if __name__ == "__main__":
    main()
