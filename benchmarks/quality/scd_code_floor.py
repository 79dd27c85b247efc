"""The error SCD's quantised codes add on their own: a model paired with ITSELF (producer =
consumer, so a perfect Reuse rebuilds the K/V exactly and raw KV is exact), calibrated once per
code dtype and code scale, then on the calibration's held-out selection prompts:

  - per layer, the relative error of the rebuilt K and V against the model's own
    (`heldout_kv_rel_err`: ||rebuilt - own|| / ||own||, keys after RoPE);
  - the continuation log-prob per token with every layer rebuilt from the codes (F_empty) against
    the model's own cache (F_oracle), and the calibration's per-level token agreement.

Code scale "none" sends the principal components at their own scale (one per-token int scale set
by the leading column); "unit" scales every code column to unit variance first (calib/fit.py
`unit_codes`). Each configuration is one `python -m sgl_kvxfer.scd.calib` run (one Patch layer,
linear aligners: the Reuse layers are what this measures), in a temp folder.

    python benchmarks/quality/scd_code_floor.py [--model DIR] [--calib A.jsonl B.jsonl]
        [--code-dtypes int4 int8] [--scales none unit] [--num-prefixes 96] [--prefix-len 256]
        [--select-prompts 16] [--r-k 32] [--r-v 64] [--device cpu] [--name NAME] [--out-dir DIR]

Writes DIR/NAME.json and .png (default DIR benchmarks/results, NAME scd_code_floor_<device tag>).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmarks.common.report import RESULTS_DIR, device_name, write_json  # noqa: E402
from sgl_kvxfer.scd.artifacts import CODE_SCALES  # noqa: E402

SHARED = os.path.join(os.path.dirname(ROOT), "shared", "data")


def run_one(args, code_dtype: str, scale: str, work: str) -> dict:
    from sgl_kvxfer.scd.calib.calibrate import calibrate, parse_args

    out = os.path.join(work, f"{code_dtype}_{scale}")
    argv = ["--producer", args.model, "--consumer", f"self={args.model}", "--calib", *args.calib, "--out", out,
            "--r-k", str(args.r_k), "--r-v", str(args.r_v), "--rank-levels", args.rank_levels, "--r-h", str(args.r_h),
            "--patch-budget", "1", "--k-max", "1", "--pool", "2", "--prefix-len", str(args.prefix_len),
            "--num-prefixes", str(args.num_prefixes), "--batch-size", "8", "--select-prompts", str(args.select_prompts),
            "--select-prefix", str(args.select_prefix), "--select-cont", str(args.select_cont),
            "--aligner-hidden", "0", "--aligner-steps", "20", "--aligner-tokens", "2048",
            "--code-dtype", code_dtype, "--code-scale", scale, "--device", args.device]
    t0 = time.time()
    report = calibrate(parse_args(argv))
    # the record names the model as given, the data beside the repo relative to it (../shared/data)
    # and the temp output as OUT, not this machine's paths
    beside = os.path.dirname(ROOT) + os.sep
    named = {args.model: args.model_arg, f"self={args.model}": f"self={args.model_arg}", out: "OUT"}
    shown = [named.get(a, os.path.relpath(a, ROOT) if a.startswith(beside) else a) for a in argv]
    held = report["heldout_kv_rel_err"]["self"]
    sel = report["selection"]
    la = report["level_agreement"]
    return {"code_dtype": code_dtype, "code_scale": scale, "wall_s": round(time.time() - t0, 1),
            "bytes_per_token": report["bytes_per_token"]["scd"], "raw_bf16_bytes_per_token": report["bytes_per_token"]["raw_bf16"],
            "reuse_k_rel_err": held["reuse_k"], "reuse_v_rel_err": held["reuse_v"],
            "mean_k_rel_err": sum(held["reuse_k"]) / len(held["reuse_k"]),
            "mean_v_rel_err": sum(held["reuse_v"]) / len(held["reuse_v"]),
            "F_codes": sel["F_empty"], "F_own": sel["F_oracle"], "F_loss": sel["F_oracle"] - sel["F_empty"],
            "levels": la["levels"], "token_agreement": la["token_agreement"],
            "calib_command": "python -m sgl_kvxfer.scd.calib " + " ".join(shown)}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for row in result["runs"]:
        label = f"{row['code_dtype']}, {row['code_scale']}"
        style = "-" if row["code_scale"] == "unit" else "--"
        axes[0].plot(row["reuse_k_rel_err"], style, label=label)
        axes[1].plot(row["reuse_v_rel_err"], style, label=label)
    for ax, what in zip(axes, ("K", "V")):
        ax.set_xlabel("layer")
        ax.set_ylabel(f"rebuilt {what}: relative error")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    names = [f"{r['code_dtype']}\n{r['code_scale']}" for r in result["runs"]]
    axes[2].bar(names, [r["F_loss"] for r in result["runs"]])
    axes[2].set_ylabel("log-prob lost per token vs own cache (nats)")
    fig.suptitle(f"SCD codes, {result['model']} paired with itself ({result['device']})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="model dir or the embedded smollm2-135m")
    ap.add_argument("--calib", nargs="+", default=[os.path.join(SHARED, f"{c}_calib.jsonl") for c in ("prose", "code")],
                    help="calibration JSONL paths or task:NAME specs (default: the shared prose and code calib splits)")
    ap.add_argument("--code-dtypes", nargs="+", default=["int4", "int8"], choices=("int4", "int8", "bfloat16"))
    ap.add_argument("--scales", nargs="+", default=list(CODE_SCALES), choices=CODE_SCALES)
    ap.add_argument("--num-prefixes", type=int, default=96)
    ap.add_argument("--prefix-len", type=int, default=256)
    ap.add_argument("--select-prompts", type=int, default=16)
    ap.add_argument("--r-k", type=int, default=32)
    ap.add_argument("--r-v", type=int, default=64)
    ap.add_argument("--rank-levels", default="16:48")
    ap.add_argument("--r-h", type=int, default=64, help="the one Patch layer's code rank")
    ap.add_argument("--select-prefix", type=int, default=256, help="held-out window: prefix tokens")
    ap.add_argument("--select-cont", type=int, default=64, help="held-out window: scored continuation tokens")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--name", default=None)
    ap.add_argument("--out-dir", default=RESULTS_DIR)
    args = ap.parse_args(argv)
    missing = [p for p in args.calib if not p.startswith("task:") and not os.path.isfile(p)]
    if missing:
        ap.error(f"no calibration file {missing[0]} (pass --calib PATH ... or task:NAME)")
    from sgl_kvxfer.models.loader import resolve_model_path

    args.model_arg, args.model = args.model, resolve_model_path(args.model)
    dev = device_name(args.device)
    result = {"benchmark": "scd_code_floor", "device": dev, "model": args.model_arg, "params": {
        k: getattr(args, k) for k in ("code_dtypes", "scales", "num_prefixes", "prefix_len", "select_prompts",
                                      "select_prefix", "select_cont", "r_k", "r_v", "r_h", "rank_levels")}, "runs": []}
    tag = dev.split(" (")[0].replace(" ", "_")
    name = args.name or f"scd_code_floor_{tag}"
    with tempfile.TemporaryDirectory() as work:
        for dtype in args.code_dtypes:
            for scale in args.scales:
                row = run_one(args, dtype, scale, work)
                result["runs"].append(row)
                print(f"[floor] {dtype} {scale}: K {row['mean_k_rel_err']:.4f} V {row['mean_v_rel_err']:.4f} "
                      f"log-prob lost {row['F_loss']:.4f} nats/token, {row['bytes_per_token']} B/token", flush=True)
                write_json(name, result, args.out_dir)  # after every run: a run cut short keeps what it measured
    plot(result, os.path.join(args.out_dir, name + ".png"))
    return result


if __name__ == "__main__":
    main()
