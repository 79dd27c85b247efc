"""The retrofit's distillation step: time and throughput per batch size, eager against compiled.

    python benchmarks/fusedkv/distill_step.py --device cuda [--model smollm2-135m] \\
        [--batches 16 32 64] [--seq 512] [--modes eager compiled] [--repeats 5] [--out-dir DIR]

The step is retrofit.DistillStep, the code the converter trains with: the teacher's forward, the
student's forward and backward, the KL + hidden-state loss, clipping and fused AdamW, bf16
autocast. Token ids are random (the time of a step does not depend on them). Each (mode, batch)
point times `repeats` blocks of `steps_per_repeat` warm steps (synchronized at both ends) after
`warmup` untimed steps; the first step's time is reported apart (with `compiled`, the compile).
`compiled` runs after every eager point: compile_blocks works in place.

Roofline: the step's matmul FLOPs (the teacher's forward, the student's forward and backward:
1 + 3 forwards; every linear layer, the tied head, causal attention's two products) against the
bf16 matmul rate measured in the same process (a 8192^3 matmul): a step cannot beat
flops / that rate. Writes fusedkv_distill_step_<model>_<device>.{json,png}.
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

MODES = ("eager", "compiled")


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def matmul_tflops(device: str, n: int) -> float:
    """The best of 5 timed n x n x n bf16 matmuls (fp32 on the CPU), in TFLOP/s."""
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e12


def step_flops(teacher, student, batch: int, seq: int) -> float:
    """Matmul FLOPs of one distillation step: teacher forward + student forward and backward."""
    def forward_flops(lm) -> float:
        c = lm.config
        linear = sum(p.numel() for n, p in lm.named_parameters()
                     if n.endswith("proj.weight"))  # q/k/v/o and the MLP's three
        head = c.vocab_size * c.hidden_size
        attn = c.num_layers * 2 * 2 * (seq / 2) * c.num_heads * c.head_dim  # QK^T and PV, causal half
        return batch * seq * (2 * (linear + head) + attn)
    return forward_flops(teacher) + 3 * forward_flops(student)


def time_point(step, ids: torch.Tensor, device: str, warmup: int, repeats: int, per_repeat: int) -> dict:
    sync(device)
    t0 = time.perf_counter()
    step(ids)
    sync(device)
    first = time.perf_counter() - t0
    for _ in range(warmup):
        step(ids)
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(per_repeat):
            step(ids)
        sync(device)
        times.append((time.perf_counter() - t0) / per_repeat)
    return {"first_step_s": first, "step_ms": [1e3 * t for t in times], "median_ms": 1e3 * statistics.median(times),
            "min_ms": 1e3 * min(times), "max_ms": 1e3 * max(times)}


def run(args) -> dict:
    from sgl_kvxfer.fusedkv.checkpoint import load_lm
    from sgl_kvxfer.fusedkv.model import compile_blocks
    from sgl_kvxfer.fusedkv.retrofit import DistillStep, RetrofitConfig, student_from
    from sgl_kvxfer.models.loader import resolve_model_path

    torch.manual_seed(0)
    model_dir = resolve_model_path(args.model)
    teacher = load_lm(model_dir, args.device)
    teacher.requires_grad_(False)
    n = teacher.config.num_layers // 2
    sources = tuple(args.sources) if args.sources else (max(0, n - 3), n - 1)
    rate = matmul_tflops(args.device, args.matmul_n)
    print(f"{device_name(args.device)}: matmul {rate:.0f} TFLOP/s", flush=True)
    rows = []
    for mode in args.modes:
        cfg = RetrofitConfig(variant=args.variant, seq=args.seq, compile=mode == "compiled")
        student = student_from(teacher, cfg, sources)
        if mode == "compiled":
            compile_blocks(student)
            compile_blocks(teacher)
        for batch in args.batches:
            step = DistillStep(student, teacher, cfg, args.device)
            for g in step.opt.param_groups:
                g["lr"] = 0.0  # timing only: the weights stay the teacher's
            ids = torch.randint(0, teacher.config.vocab_size, (batch, args.seq), device=args.device)
            if args.device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            t = time_point(step, ids, args.device, args.warmup, args.repeats, args.steps_per_repeat)
            flops = step_flops(teacher, student, batch, args.seq)
            row = {"mode": mode, "batch": batch, "seq": args.seq, "tokens_per_step": batch * args.seq, **t,
                   "tokens_per_s": batch * args.seq / (t["median_ms"] / 1e3), "step_tflop": flops / 1e12,
                   "achieved_tflops": flops / (t["median_ms"] / 1e3) / 1e12,
                   "min_step_ms_at_matmul_rate": 1e3 * flops / (rate * 1e12)}
            row["fraction_of_matmul_rate"] = row["min_step_ms_at_matmul_rate"] / row["median_ms"]
            if args.device.startswith("cuda"):
                row["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9
            rows.append(row)
            print(f"{mode:8s} batch {batch:3d}: {row['median_ms']:.1f} ms ({row['min_ms']:.1f}..{row['max_ms']:.1f}), "
                  f"{row['tokens_per_s'] / 1e3:.1f}k tokens/s, {100 * row['fraction_of_matmul_rate']:.0f}% of the "
                  f"matmul rate, first step {row['first_step_s']:.1f} s", flush=True)
            del step
        del student
    eager = {r["batch"]: r for r in rows if r["mode"] == "eager"}
    for r in rows:
        base = eager.get(args.batches[0])
        if base:
            r["tokens_per_s_vs_eager_first_batch"] = r["tokens_per_s"] / base["tokens_per_s"]
    best = max(rows, key=lambda r: r["tokens_per_s"])
    return {"model": os.path.basename(os.path.normpath(model_dir)), "sources": list(sources),
            "matmul_tflops": rate, "rows": rows, "best": {"mode": best["mode"], "batch": best["batch"],
                                                         "tokens_per_s": best["tokens_per_s"]}}


def plot(path: str, title: str, rows: list[dict]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for mode in MODES:
        rs = [r for r in rows if r["mode"] == mode]
        if rs:
            ax.errorbar([r["batch"] for r in rs], [r["tokens_per_s"] / 1e3 for r in rs],
                        yerr=[[r["tokens_per_s"] / 1e3 * (1 - r["median_ms"] / r["max_ms"]) for r in rs],
                              [r["tokens_per_s"] / 1e3 * (r["median_ms"] / r["min_ms"] - 1) for r in rs]],
                        marker="o", capsize=3, label=mode)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch (windows of seq tokens)")
    ax.set_ylabel("distillation tokens / s (thousands)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="a model dir or an embedded model name")
    p.add_argument("--variant", default="fusedkv", choices=("fusedkv", "lite"))
    p.add_argument("--sources", type=int, nargs=2, default=None, help="source layers (default: n-3, n-1 of the n storage layers)")
    p.add_argument("--batches", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps-per-repeat", type=int, default=5)
    p.add_argument("--matmul-n", type=int, default=8192)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out-dir", default=None)
    args = p.parse_args(argv)
    if args.repeats < 5 or args.warmup < 1 or args.steps_per_repeat < 1 or min(args.batches) < 1 or args.seq < 8:
        p.error("need --repeats >= 5, --warmup >= 1, --steps-per-repeat >= 1, batches >= 1, --seq >= 8")
    if args.modes != sorted(args.modes, key=MODES.index):
        p.error("--modes: eager before compiled (compile_blocks works in place)")
    device = device_name(args.device)
    result = run(args)
    tag = "cpu" if args.device == "cpu" else device.split(" (")[0].replace(" ", "_")
    payload = {"benchmark": "fusedkv_distill_step", "device": device, "commit": git_commit(), "params": vars(args),
               **result}
    path = write_json(f"fusedkv_distill_step_{result['model']}_{tag}", payload, args.out_dir)
    plot(path[:-5] + ".png", f"retrofit distillation step, {result['model']}, seq {args.seq}, {device}", result["rows"])
    print("wrote", path, flush=True)
    return path


if __name__ == "__main__":
    main()
