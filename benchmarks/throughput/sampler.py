"""The sampler's time per decode step: the batched draw against a per-row draw, side by side.

    python benchmarks/throughput/sampler.py --device cuda [--vocab 49152] [--batches 1 64 256 512] \\
        [--repeats 5] [--calls 20] [--out-dir DIR]

`sampling.sampler.sample` draws every sampled row of a step together (one softmax, one float64
inverse-CDF lookup, one host read). `per_row` below is the other way to draw the same
distribution: for each row its own softmax, a host copy of its probabilities and a seeded
torch.multinomial. Both get fp32 logits [batch, vocab] on the device, temperature 1 and a seed
per row (each row its own torch.Generator, as a request with `sampling_seed` has). Each point
times `repeats` blocks of `calls` warm calls (the tokens read back to the host: a step needs
them); median and min..max per call. Roofline: the batched draw reads the logits once and
writes the float64 CDF once (12 bytes per logit); at the device's copy bandwidth (measured in the
same run) a call cannot take less. Writes sampler_<device>.{json,png}.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.report import device_name, git_commit, write_json  # noqa: E402

from sgl_kvxfer.sampling.params import SamplingParams  # noqa: E402
from sgl_kvxfer.sampling.sampler import sample  # noqa: E402


def per_row(logits: torch.Tensor, generators: list[torch.Generator]) -> list[int]:
    """One softmax, one host copy and one seeded multinomial per row (temperature 1)."""
    out = []
    for i, gen in enumerate(generators):
        probs = torch.softmax(logits[i], dim=-1).float().cpu()
        out.append(int(torch.multinomial(probs, 1, generator=gen).item()))
    return out


def copy_gbps(device: str, nbytes: int = 1 << 28) -> float:
    """Device-to-device copy bandwidth (read + write bytes per second), best of 5."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best / 1e9


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_calls(fn, repeats: int, calls: int, device: str) -> list[float]:
    fn()  # warm
    per_call = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        per_call.append((time.perf_counter() - t0) / calls)
    return per_call


def run(args) -> dict:
    params_cache: dict[int, list] = {}
    rows = []
    bw = copy_gbps(args.device)
    for batch in args.batches:
        gen = torch.Generator(device=args.device).manual_seed(batch)
        logits = torch.randn(batch, args.vocab, device=args.device, generator=gen) * 3
        params = params_cache.setdefault(batch, [SamplingParams.from_dict({"temperature": 1.0, "sampling_seed": i})
                                                 for i in range(batch)])
        gens = [torch.Generator().manual_seed(i) for i in range(batch)]
        floor_ms = 12 * batch * args.vocab / (bw * 1e9) * 1e3
        for method, fn in (("batched", lambda: sample(logits, params, gens)), ("per_row", lambda: per_row(logits, gens))):
            t = time_calls(fn, args.repeats, args.calls if method == "batched" else max(1, args.calls // 4), args.device)
            med = statistics.median(t)
            rows.append({"method": method, "batch": batch, "median_ms": med * 1e3, "min_ms": min(t) * 1e3,
                         "max_ms": max(t) * 1e3, "samples_ms": [x * 1e3 for x in t], "byte_floor_ms": floor_ms})
            print(f"batch {batch:4d} {method:8s} {med * 1e3:8.3f} ms ({min(t) * 1e3:.3f}..{max(t) * 1e3:.3f}); "
                  f"byte floor {floor_ms:.3f} ms", flush=True)
    for batch in args.batches:
        b, p = (next(r for r in rows if r["batch"] == batch and r["method"] == m) for m in ("batched", "per_row"))
        b["per_row_over_batched"] = p["median_ms"] / b["median_ms"]
    return {"rows": rows, "copy_gbps": bw}


def plot(path: str, title: str, rows: list[dict]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for method in ("batched", "per_row"):
        rs = [r for r in rows if r["method"] == method]
        ax.errorbar([r["batch"] for r in rs], [r["median_ms"] for r in rs],
                    yerr=[[r["median_ms"] - r["min_ms"] for r in rs], [r["max_ms"] - r["median_ms"] for r in rs]],
                    marker="o", capsize=3, label=method)
    rs = [r for r in rows if r["method"] == "batched"]
    ax.plot([r["batch"] for r in rs], [r["byte_floor_ms"] for r in rs], "k:", label="batched: byte floor")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("rows sampled per step")
    ax.set_ylabel("ms per step (tokens on the host)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256, 512])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--calls", type=int, default=20, help="calls per repeat (per_row: a quarter)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out-dir", default=None)
    args = p.parse_args(argv)
    if args.repeats < 5 or args.calls < 1 or min(args.batches) < 1 or args.vocab < 2:
        p.error("need --repeats >= 5, --calls >= 1, batches >= 1, --vocab >= 2")
    device = device_name(args.device)
    result = run(args)
    tag = "cpu" if args.device == "cpu" else device.split(" (")[0].replace(" ", "_")
    payload = {"benchmark": "sampler", "device": device, "commit": git_commit(), "params": vars(args), **result}
    path = write_json(f"sampler_{tag}", payload, args.out_dir)
    plot(path[:-5] + ".png", f"sampling a step: batched vs per row, vocab {args.vocab}, {device}", result["rows"])
    print("wrote", path, flush=True)
    return path


if __name__ == "__main__":
    main()
