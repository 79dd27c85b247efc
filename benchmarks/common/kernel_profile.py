"""Device time of one decode step, per kernel and per kernel group, under torch.profiler.

    kernel_breakdown(run, n1, n2, cuda)   run(n) generates n tokens for a fixed, already prefilled
                                          batch; the step's kernels are (profile(run(n2)) -
                                          profile(run(n1))) / (n2 - n1), so the re-prefill both
                                          calls share cancels

On a GPU the profiler records CUDA kernels, those a CUDA graph replays included; on the CPU there
are no kernels and the same difference runs over operators' self CPU time. `busy_s`, the summed
kernel time of a step, against the unprofiled step time says how much of a step the GPU computes
(the rest is launch gaps, kernel tails and host time).
"""
from __future__ import annotations

from typing import Callable

# first match wins: the block tables and the tier and FusedKV kernels before the generic names
KERNEL_GROUPS = (
    ("block tables", ("_tier_tables", "_tier_counts", "_tier_write")),
    ("fusedkv attention", ("fusedkv",)),
    ("tiered attention", ("tiered", "tier_", "one_launch")),
    ("attention", ("attn", "attention", "flash", "decode")),
    ("matmul", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas", "matmul", "addmm", "linear")),
    ("sampling / sort", ("softmax", "cumsum", "searchsorted", "argmax", "topk", "sort")),
    ("norm / rope / activation", ("norm", "rope", "rotary", "silu", "gelu", "act_and_mul")),
    ("copy / index", ("memcpy", "memset", "copy", "cat", "index", "gather", "scatter")),
    ("elementwise", ("elementwise", "triton_poi")),
)


def kernel_group(name: str) -> str:
    low = name.lower()
    return next((group for group, keys in KERNEL_GROUPS if any(k in low for k in keys)), "other")


def profiled_kernel_s(run: Callable[[], object], cuda: bool) -> tuple[dict[str, float], dict[str, int]]:
    """({kernel name: seconds}, {kernel name: launches}) over one run() under torch.profiler: CUDA
    kernels on a GPU, operators' self CPU time on the CPU."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        run()
    secs: dict[str, float] = {}
    calls: dict[str, int] = {}
    if cuda:
        from torch.autograd import DeviceType

        for e in prof.profiler.kineto_results.events():
            if e.device_type() == DeviceType.CUDA:
                secs[e.name()] = secs.get(e.name(), 0.0) + e.duration_ns() * 1e-9
                calls[e.name()] = calls.get(e.name(), 0) + 1
    else:
        for e in prof.key_averages():
            secs[e.key] = secs.get(e.key, 0.0) + e.self_cpu_time_total * 1e-6
            calls[e.key] = calls.get(e.key, 0) + e.count
    return secs, calls


def kernel_breakdown(run: Callable[[int], object], n1: int, n2: int, cuda: bool, top: int = 12) -> dict:
    """One decode step's device time per kernel and per group (KERNEL_GROUPS), by the difference
    of run(n2) and run(n1) (module docstring). Per kernel: seconds and launches a step."""
    if not 1 <= n1 < n2:
        raise ValueError(f"need 1 <= n1 < n2, got {n1}, {n2}")
    a, ca = profiled_kernel_s(lambda: run(n1), cuda)
    b, cb = profiled_kernel_s(lambda: run(n2), cuda)
    per_step = {k: (b.get(k, 0.0) - a.get(k, 0.0)) / (n2 - n1) for k in set(a) | set(b)}
    per_step = {k: v for k, v in per_step.items() if v > 0}
    launches = {k: (cb.get(k, 0) - ca.get(k, 0)) / (n2 - n1) for k in per_step}
    groups: dict[str, float] = {}
    group_launches: dict[str, float] = {}
    for k, v in per_step.items():
        g = kernel_group(k)
        groups[g] = groups.get(g, 0.0) + v
        group_launches[g] = group_launches.get(g, 0.0) + launches[k]
    ranked = sorted(per_step.items(), key=lambda kv: -kv[1])
    return {"unit": "kernel" if cuda else "cpu_op", "busy_s": sum(per_step.values()),
            "launches_per_step": sum(launches.values()),
            "groups_s": dict(sorted(groups.items(), key=lambda kv: -kv[1])),
            "group_launches_per_step": group_launches,
            "top_s": [{"name": k[:160], "group": kernel_group(k), "s": v, "launches": launches[k]}
                      for k, v in ranked[:top]]}
