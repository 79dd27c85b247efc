"""Nsight Compute figures of the tiered pool's decode kernels at one point (default Llama-3-8B heads,
batch 8, 32k): DRAM throughput (% of peak), achieved occupancy, issue slots busy, registers, shared memory and the
top warp stall reason of each tier's kernel, from one ncu run; `sdpa` adds torch SDPA on dense K/V
at the same point (`--sdpa-backend`, cuDNN by default: the attention table's SDPA there) in a
second ncu run, every kernel it launches inside the NVTX range `profile`.

    python benchmarks/kernels/ncu_decode.py --out-dir DIR [--point llama3-8b:8:32768]
        [--variants int8 int4 fp16 sdpa] [--config JSON] [--name NAME]   # runs ncu on itself, writes NAME.json
    python benchmarks/kernels/ncu_decode.py --target ...      # what ncu profiles (one warm-up, then the launches)

The layouts are attention.py's (engine_layout.py: the engine's TieredKVPool, its int page). ncu
sections SpeedOfLight, Occupancy, LaunchStats, WarpStateStats and ComputeWorkloadAnalysis, raw page as CSV; the stall
reason is the largest `smsp__average_warp*issue_stalled_*` ratio ncu reports. Needs `ncu` on
PATH and permission to read the GPU's counters; otherwise the JSON says why.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

KERNELS = {"fp16": "_fp16_tier_kernel", "int8": "_int_tier_kernel", "int4": "_int_tier_kernel",
           "sdpa": None}  # None: every kernel inside the NVTX range PROFILE_RANGE (its own ncu run)
PROFILE_RANGE = "profile"
SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats", "ComputeWorkloadAnalysis")


def sdpa_target(args) -> None:
    """torch SDPA (enable_gqa) of one decode step over dense K/V [B, Hkv, ctx, D] at the point,
    the backend forced: one warm-up, then one call inside the NVTX range PROFILE_RANGE."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from attention import MODELS, parse_point

    model, B, ctx = parse_point(args.point)
    Hq, Hkv, D = MODELS[model]
    dev = torch.device("cuda")
    q = torch.randn(B, Hq, 1, D, dtype=torch.float16, device=dev)
    k = torch.randn(B, Hkv, ctx, D, dtype=torch.float16, device=dev)
    v = torch.randn_like(k)
    with sdpa_kernel(getattr(SDPBackend, args.sdpa_backend)):
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # warm-up (and cuDNN's plan)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(PROFILE_RANGE)
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()


def target(args) -> None:
    """Build each variant's layout, launch its decode once to compile, then once per variant (the
    launches ncu profiles, in --variants order)."""
    if args.variants == ["sdpa"]:
        sdpa_target(args)
        return
    import torch

    from attention import MODELS, parse_point, split_config, tiered_layout
    from sgl_kvxfer.kernels.tiered_pool_decode import plan_tiered_pool_decode, served_config, tiered_pool_decode

    model, B, ctx = parse_point(args.point)
    Hq, Hkv, D = MODELS[model]
    dev = torch.device("cuda")
    entry = json.loads(args.config) if args.config else None
    cfg, page = split_config(entry)
    cfg = cfg or served_config(D, Hq // Hkv)
    q = torch.randn(B, Hq, D, dtype=torch.float16, device=dev)
    runs = []
    for v in args.variants:
        lay = tiered_layout(B, ctx, Hkv, D, q, v, dev, max_bytes=1, int_page=page)  # one copy
        plan = plan_tiered_pool_decode(B, Hkv, lay.max_tokens, dev, cfg)
        runs.append((lay, plan))
        tiered_pool_decode(q, lay.layer, lay.tables[0], plan=plan, config=cfg, tiers=lay.tiers)  # compile
    torch.cuda.synchronize()
    for lay, plan in runs:  # the profiled launches
        tiered_pool_decode(q, lay.layer, lay.tables[0], plan=plan, config=cfg, tiers=lay.tiers)
    torch.cuda.synchronize()


def parse_raw_csv(text: str) -> list[dict]:
    """ncu --csv --page raw -> one dict per profiled kernel {metric name: value string}."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    if len(lines) < 3:
        return []
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    head, body = rows[0], rows[2:]  # rows[1]: units
    return [dict(zip(head, r)) for r in body]


def _num(x) -> float | None:
    try:
        return float(str(x).replace(",", ""))
    except (TypeError, ValueError):
        return None


def summarize(kernel: dict) -> dict:
    """The figures the report quotes, from one kernel's raw metrics."""
    def first(*names):
        for n in names:
            if _num(kernel.get(n)) is not None:
                return _num(kernel[n])
        return None

    stalls = {}
    for name, val in kernel.items():
        if "issue_stalled" in name and name.endswith(".ratio") and _num(val) is not None:
            reason = name.split("issue_stalled_")[1].split("_per_")[0].split(".")[0]
            stalls[reason] = max(stalls.get(reason, 0.0), _num(val))
    top = sorted(stalls.items(), key=lambda kv: -kv[1])[:4]
    return {
        "kernel": kernel.get("Kernel Name", "?")[:80],
        "duration_us": (first("gpu__time_duration.sum") or 0) / 1e3 or None,
        "dram_throughput_pct": first("gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
                                     "dram__throughput.avg.pct_of_peak_sustained_elapsed"),
        "achieved_occupancy_pct": first("sm__warps_active.avg.pct_of_peak_sustained_active"),
        # issue slots busy: near 100% the loop is bound by its instruction count, not by the bytes
        "issue_slots_busy_pct": first("sm__inst_issued.avg.pct_of_peak_sustained_active",
                                      "sm__instruction_throughput.avg.pct_of_peak_sustained_active"),
        "theoretical_occupancy_pct": first("sm__maximum_warps_per_active_cycle_pct"),
        "registers_per_thread": first("launch__registers_per_thread"),
        "shared_mem_per_block_bytes": first("launch__shared_mem_per_block"),
        "grid_size": first("launch__grid_size"), "block_size": first("launch__block_size"),
        "top_stalls": [{"reason": r, "warps_per_issue": round(v, 3)} for r, v in top],
    }


def drive(args) -> dict:
    from common.report import git_commit

    out = {"benchmark": "ncu of the tiered pool decode", "commit": git_commit(), "point": args.point,
           "variants": args.variants, "config": args.config, "sections": list(SECTIONS)}
    ncu = shutil.which("ncu")
    if ncu is None:
        out["error"] = "ncu not on PATH"
        return out
    tiered = [v for v in args.variants if KERNELS[v]]
    runs = ([(tiered, ncu_command(ncu, args, tiered))] if tiered else []) + (
        [(["sdpa"], ncu_command(ncu, args, ["sdpa"]))] if "sdpa" in args.variants else [])
    out["command"] = " ; ".join(" ".join(cmd) for _, cmd in runs)
    out["kernels"], out["raw"] = [], []
    for variants, cmd in runs:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        out.setdefault("returncodes", []).append(proc.returncode)
        kernels = parse_raw_csv(proc.stdout)
        if not kernels:
            out["error"] = f"no kernel profiled for {variants}"
            out["stdout_tail"] = proc.stdout[-3000:]
            out["stderr_tail"] = proc.stderr[-3000:]
            continue
        # the tiered run: one kernel per variant, in order; SDPA's: every kernel of its call
        names = ["sdpa"] * len(kernels) if variants == ["sdpa"] else variants
        out["kernels"] += [dict(variant=v, **summarize(k)) for v, k in zip(names, kernels)]
        out["raw"] += kernels
    return out


def ncu_command(ncu: str, args, variants: list[str]) -> list[str]:
    """The ncu command line profiling `variants` of this script's --target: the tiered kernels by
    name after their compile launches, SDPA (alone) as every kernel inside PROFILE_RANGE."""
    if variants == ["sdpa"]:
        select = ["--nvtx", "--nvtx-include", f"{PROFILE_RANGE}/"]
        extra = ["--sdpa-backend", args.sdpa_backend]
    else:
        if "sdpa" in variants:
            raise ValueError("sdpa runs in its own ncu command")
        names = "|".join(sorted({KERNELS[v] for v in variants}))
        select = ["--kernel-name", f"regex:{names}", "--launch-skip", str(len(variants)),
                  "--launch-count", str(len(variants))]
        extra = ["--config", args.config] if args.config else []
    return [ncu, "--target-processes", "all", *select,
            *[a for s in SECTIONS for a in ("--section", s)], "--csv", "--page", "raw",
            sys.executable, os.path.abspath(__file__), "--target", "--point", args.point,
            "--variants", *variants, *extra]


def main(argv=None) -> None:
    from common.bandwidth import SDPA_BACKENDS

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--point", default="llama3-8b:8:32768", help="MODEL:BATCH:CONTEXT")
    ap.add_argument("--variants", nargs="+", default=["int8", "int4"], choices=list(KERNELS))
    ap.add_argument("--config", default=None, help="JSON object: TieredDecodeConfig fields (+ int_page)")
    ap.add_argument("--sdpa-backend", default="CUDNN_ATTENTION", choices=SDPA_BACKENDS,
                    help="the SDPA backend the sdpa variant forces")
    ap.add_argument("--name", default="ncu_decode", help="the JSON's name in --out-dir")
    ap.add_argument("--target", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds ncu may run")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    if args.target:
        target(args)
        return
    from common.report import write_json

    import torch

    res = drive(args)
    res["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    for k in res.get("kernels", []):
        print(f"{k['variant']}: {k['duration_us']} us, DRAM {k['dram_throughput_pct']}%, occupancy "
              f"{k['achieved_occupancy_pct']}% (theoretical {k['theoretical_occupancy_pct']}%), regs "
              f"{k['registers_per_thread']}, smem {k['shared_mem_per_block_bytes']}, top stalls {k['top_stalls']}")
    if "error" in res:
        print("ncu:", res["error"], res.get("stderr_tail", "")[-1500:])
    print("wrote", write_json(args.name, res, args.out_dir))


if __name__ == "__main__":
    main()
