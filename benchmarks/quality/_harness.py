"""Shared plumbing of the SpectrumKV quality benchmarks: engines, eval windows, metadata.

Everything runs through `sgl_kvxfer.Engine` (the radix cache, the tiered pool and the
scheduler's tiering hooks); a method/budget point is applied to one long-lived tiered engine
with `scheduler.tiering.using(policy=..., budget=..., unit=...)` and a cache flush, which is what
a fresh engine with those flags would do, minus the model load.
"""
from __future__ import annotations

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmarks.common.report import device_name, git_commit, write_json  # noqa: E402

RESULTS_DIR = os.path.join(ROOT, "benchmarks", "results")
# the eval prose: --prose, else $SGL_KVXFER_PROSE, else the shared data beside the checkout
PROSE = os.environ.get("SGL_KVXFER_PROSE") or os.path.join(os.path.dirname(ROOT), "shared", "data",
                                                           "prose_eval.jsonl")
ALL_METHODS = ("greedy", "sink-protect", "adaptive-2tier", "balanced", "random-tier", "uniform-int8",
               "uniform-int4", "pdtrim", "sws")


def add_common_args(ap) -> None:
    ap.add_argument("--quick", action="store_true", help="few windows / depths / points (CPU smoke run)")
    ap.add_argument("--device", default="auto", help="cpu | cuda | auto")
    ap.add_argument("--dtype", default="bfloat16", help="model dtype (bf16 keeps KV bytes literal)")
    ap.add_argument("--model", default=None, help="model path or .gguf (default: embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--prose", default=PROSE, help="JSONL of {\"text\": ...} eval prose (default: "
                    "$SGL_KVXFER_PROSE, else ../shared/data/prose_eval.jsonl beside the checkout)")
    ap.add_argument("--out-dir", default=RESULTS_DIR)
    ap.add_argument("--max-total-tokens", type=int, default=None, help="KV pool size (default: memory-based)")
    ap.add_argument("--kv-quant-group-size", type=int, default=None,
                    help="channels per int-tier scale/zero of the tiered engine (default: the engine's)")
    ap.add_argument("--plot-only", default=None, help="re-plot an existing JSON and exit")


def engine_kwargs(args) -> dict:
    kw = {"dtype": args.dtype, "device": args.device, "attention_backend": "torch"}
    if args.max_total_tokens:
        kw["max_total_tokens"] = args.max_total_tokens
    return kw


def make_engines(args, tiered_kwargs: dict):
    """(untiered engine at b = 1.0, tiered engine). The tiered one's configured policy only sizes
    its stores; every point overrides policy/budget/unit."""
    from sgl_kvxfer import Engine

    _check_prose(args.prose)  # before minutes of model loading
    base = Engine(args.model, **engine_kwargs(args))
    if getattr(args, "kv_quant_group_size", None):
        tiered_kwargs = {**tiered_kwargs, "kv_quant_group_size": args.kv_quant_group_size}
    tiered = Engine(args.model, **engine_kwargs(args), **tiered_kwargs)
    return base, tiered


def _check_prose(path: str) -> None:
    if not os.path.isfile(path):
        raise SystemExit(f"eval prose {path} not found: pass --prose FILE or set SGL_KVXFER_PROSE (JSONL rows "
                         "of {\"text\": ...}; the project's shared data keeps it as ../shared/data/prose_eval.jsonl "
                         "beside the checkout)")


def load_texts(path: str) -> list[str]:
    _check_prose(path)
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def _dirty() -> bool | None:
    import subprocess

    try:
        return bool(subprocess.check_output(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                            text=True).strip())
    except (OSError, subprocess.CalledProcessError):
        return None


def metadata(args, engine, extra: dict) -> dict:
    runner = engine.runner
    return {"device": device_name(runner.device), "commit": git_commit(), "uncommitted_changes": _dirty(),
            "torch_device": runner.device,
            "dtype": str(runner.dtype).replace("torch.", ""), "model": runner.model_dir,
            "argv": sys.argv[1:], "params": {**vars(args), **extra}, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                          time.gmtime())}


def write(out_dir: str, name: str, payload: dict) -> str:
    """OUT_DIR/NAME.json through common.report.write_json (device, commit and command recorded)."""
    return write_json(name, payload, out_dir)


def device_tag(engine) -> str:
    return device_name(engine.runner.device).split(" (")[0].replace(" ", "_").replace("(R)", "")[:40]


def tier_stats(records, rids: set[str]) -> dict:
    """Tier mix, byte ratio and store fallbacks of the prefill runs (start 0) of `rids`."""
    rows = [r for r in records if r.rid in rids and r.start == 0]
    asked = [sum(r.asked[t] for r in rows) for t in range(4)]
    got = [sum(r.got[t] for r in rows) for t in range(4)]
    n = max(sum(got), 1)
    return {"tier_fractions": [g / n for g in got],
            "byte_ratio": sum(r.byte_ratio * (r.end - r.start) for r in rows) / n,
            "fallback_tokens": sum(abs(a - g) for a, g in zip(asked, got)) // 2}


def load_for_plot(path: str):
    """(pyplot, result dict) for a results JSON; matplotlib on the Agg backend."""
    import json

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        return plt, json.load(f)


def save_plot(fig, path: str) -> str:
    """Write `fig` beside the results JSON `path` as .png."""
    fig.tight_layout()
    out = os.path.splitext(path)[0] + ".png"
    fig.savefig(out, dpi=120)
    print("wrote", out)
    return out


def run_then_plot(args, run, plot) -> None:
    """`--plot-only PATH` re-plots a saved JSON; otherwise run, then plot what it wrote."""
    path = args.plot_only or run(args)
    try:
        plot(path)
    except ImportError:
        print("matplotlib not installed: re-plot later with --plot-only", path)
