"""Convert a Llama-family model directory into a FusedKV or FusedKV-Lite model directory.

    python -m sgl_kvxfer.fusedkv.convert --model DIR --variant fusedkv|lite --out DIR \\
        [--train-data DIR] [--budget-min N] [--report PATH]

The result is served as is: `python -m sgl_kvxfer.launch_server --model-path OUT`. The model
keeps KV for the bottom half of its layers; the top half rebuilds it from two of them
(docs/fusedkv.md). The conversion is a retrofit by distillation from the original model
(retrofit.py) within --budget-min minutes of training (evaluation excluded; 0: least squares
only); --train-data (or SGL_KVXFER_FUSEDKV_DATA) is a folder of {domain}_{train,calib,eval}.jsonl
files or their token files (data.py). A progress bar follows the budget; the last line gives the
held-out perplexity of the original and the converted model per eval domain. --tasks also scores
both on the task suite through the engine (task_eval.py). --report writes the run's JSON (the PPL
curve against training GPU-minutes and its extrapolation) and a PNG beside it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys

import torch

from sgl_kvxfer.fusedkv.retrofit import INITS, SCOPES, RetrofitConfig


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}")
    if not math.isfinite(v) or v < 0 or v > 10080:
        raise argparse.ArgumentTypeError(f"must be a finite number of minutes in [0, 10080], got {text!r}")
    return v


def _float_in(lo: float, hi: float, hi_open: bool = False):
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}")
        if not (math.isfinite(v) and lo <= v and (v < hi if hi_open else v <= hi)):
            raise argparse.ArgumentTypeError(f"must be in [{lo}, {hi}{')' if hi_open else ']'}, got {text!r}")
        return v
    return parse


_nonneg_float = _float_in(0.0, 1e6)
_ema_decay = _float_in(0.0, 1.0, hi_open=True)


def _int_at_least(lo: int, hi: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}")
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"must be in [{lo}, {hi}], got {v}")
        return v
    return parse


def build_parser() -> argparse.ArgumentParser:
    d = RetrofitConfig()
    ap = argparse.ArgumentParser(prog="python -m sgl_kvxfer.fusedkv.convert", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the original model: a dir with config.json + *.safetensors, "
                    "or an embedded model name")
    ap.add_argument("--variant", required=True, choices=("fusedkv", "lite"))
    ap.add_argument("--out", required=True, help="the converted model dir (created; must not be --model)")
    ap.add_argument("--train-data", default=None, help="data folder (default: $SGL_KVXFER_FUSEDKV_DATA)")
    ap.add_argument("--budget-min", type=_positive_float, default=d.budget_s / 60,
                    help="training minutes (init + local + distill; evaluation excluded)")
    ap.add_argument("--num-storage-layers", type=_int_at_least(1, 10**4), default=None,
                    help="layers that keep KV (default: half)")
    ap.add_argument("--init", choices=[i.replace("_", "-") for i in INITS], default=d.init.replace("_", "-"),
                    help="FusedKV's start: closed-form (fusion weights, q_proj rotations and o_proj fitted to the "
                    "original's activations) or channel-lstsq (the fusion weights alone, per channel)")
    ap.add_argument("--train-scope", choices=SCOPES, default=d.train_scope,
                    help="all: every weight trains; blocks: all but the token embedding (and output head); attn: the "
                    "attention projections and fusion weights; top: the reconstruction layers and the final norm only")
    ap.add_argument("--seq", type=_int_at_least(8, 1 << 16), default=d.seq)
    ap.add_argument("--batch", type=_int_at_least(1, 4096), default=d.batch)
    ap.add_argument("--shift-windows", action="store_true",
                    help="cut the training windows at a fresh offset every pass over the text (other contexts for the same tokens)")
    ap.add_argument("--lr", type=float, default=d.lr, help="peak learning rate of the pretrained weights "
                    "in the distill phase (fusion weights keep their own)")
    ap.add_argument("--anchor-decay", type=_nonneg_float, default=d.anchor_decay,
                    help="distill phase: after each step pull every pretrained weight towards its value at the "
                    "phase's start by lr x this of the gap (0: off)")
    ap.add_argument("--ema", type=_ema_decay, default=d.ema,
                    help="distill phase: evaluate and save an exponential moving average of the weights with "
                    "this decay, e.g. 0.999 (0: off)")
    ap.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                    help="torch.compile the blocks and losses for distillation (fewer kernel launches; the "
                    "compile time, ~20 s on a GPU, counts in the budget); auto: on for CUDA, off on the CPU")
    ap.add_argument("--calib-windows", type=_int_at_least(1, 1 << 16), default=d.calib_windows,
                    help="windows of --seq tokens for the source search and the least-squares fit")
    ap.add_argument("--eval-windows", type=_int_at_least(1, 1 << 16), default=d.eval_windows,
                    help="held-out windows per eval domain")
    ap.add_argument("--eval-seq", type=_int_at_least(8, 1 << 16), default=None,
                    help="tokens per held-out window (default: --seq); longer windows score positions "
                    "past the training windows' length")
    ap.add_argument("--tasks", default=None, help="after converting, score the original and the converted model "
                    "on these task-suite tasks through the engine, e.g. qa,kv,needle,code (sgl_kvxfer/tasks)")
    ap.add_argument("--task-n", type=_int_at_least(1, 10**5), default=50, help="eval items per task")
    ap.add_argument("--dtype", default="auto", help="the engine's dtype for --tasks")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--report", default=None, help="write the run's JSON here (and a PNG of the curve beside it)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def main(argv: list[str] | None = None) -> dict:
    ap = build_parser()
    a = ap.parse_args(argv)
    from sgl_kvxfer.utils.triton_cpu import use_interpreter_on_cpu

    use_interpreter_on_cpu(a.device)  # before any kernel import: --tasks runs the engine here
    from sgl_kvxfer.fusedkv.checkpoint import save_model_dir
    from sgl_kvxfer.fusedkv.data import Tokenized, resolve_data_dir
    from sgl_kvxfer.fusedkv.retrofit import run_retrofit
    from sgl_kvxfer.models.loader import resolve_model_path
    from sgl_kvxfer.utils.provenance import source_commit

    names = None
    if a.tasks:
        from sgl_kvxfer import tasks

        try:
            names = list(tasks.parse_mix(a.tasks))
        except (KeyError, ValueError) as exc:
            ap.error(f"--tasks: {exc}")
    model_dir = resolve_model_path(a.model)
    if os.path.abspath(a.out) == os.path.abspath(model_dir):
        ap.error("--out must differ from --model")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {a.device}: no CUDA device here")
    compile_on = a.compile == "on" or (a.compile == "auto" and a.device.startswith("cuda"))
    try:
        cfg = RetrofitConfig(variant=a.variant, num_storage_layers=a.num_storage_layers, budget_s=a.budget_min * 60,
                             init=a.init.replace("-", "_"),
                             train_scope=a.train_scope, seq=a.seq, batch=a.batch, eval_windows=a.eval_windows,
                             eval_seq=a.eval_seq,
                             calib_windows=a.calib_windows, compile=compile_on, lr=a.lr,
                             shift_windows=a.shift_windows, anchor_decay=a.anchor_decay, ema=a.ema)
    except ValueError as exc:
        ap.error(str(exc))
    data = Tokenized(resolve_data_dir(a.train_data), model_dir)
    print(f"converting {model_dir} -> {a.out} ({a.variant}, {a.budget_min:g} min of training on {a.device})", flush=True)
    try:
        student, report = run_retrofit(model_dir, data, cfg, a.device, progress=not a.no_progress)
    except ValueError as exc:  # e.g. a model shape the compact LM does not cover
        raise SystemExit(f"cannot convert {model_dir}: {exc}")
    save_model_dir(student, model_dir, a.out)
    del student
    report.update(model=model_dir, model_name=os.path.basename(os.path.normpath(model_dir)), out=a.out,
                  device=_device_name(a.device), commit=source_commit(),
                  command=shlex.join(["python", "-m", "sgl_kvxfer.fusedkv.convert", *(sys.argv[1:] if argv is None else argv)]))
    # written before the task suite, again after it: a SIGINT or a kill during the suite (a stage's
    # time limit) leaves the PPL report and its curve on disk
    _write_report(report, a.report)
    if names and report.get("interrupted"):
        report["task_scores"] = {"error": "skipped: the retrofit was interrupted (SIGINT)"}
        print("task scoring skipped: the retrofit was interrupted", flush=True)
    elif names:
        from sgl_kvxfer.fusedkv.task_eval import compare

        try:
            report["task_scores"] = compare(model_dir, a.out, names, a.task_n, 0, a.device, a.dtype)
        except Exception as exc:  # noqa: BLE001 - the model dir and the PPL report stand without them
            report["task_scores"] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            print(f"task scoring failed: {report['task_scores']['error']}", flush=True)
        _write_report(report, a.report)
    print(f"wrote {a.out}" + (f" and {a.report}" if a.report else ""), flush=True)
    if names and "error" not in report["task_scores"]:
        from sgl_kvxfer import tasks

        ts = report["task_scores"]
        print("tasks (headline, points): " + "; ".join(
            f"{t} {tasks.headline(t)}: original {100 * ts['original'][t][tasks.headline(t)]:.1f}, converted "
            f"{100 * ts['converted'][t][tasks.headline(t)]:.1f} ({ts['headline_points'][t]:+.1f})" for t in names),
            flush=True)
    print("PPL " + "; ".join(f"{d}: original {report['teacher_ppl'][d]:.3f}, converted {p:.3f} "
                             f"({100 * report['final_rel'][d]:+.2f}%)" for d, p in report["final_ppl"].items()),
          flush=True)
    return report


def _write_report(report: dict, path: str | None) -> None:
    """The run's JSON at path and the curve's PNG beside it (nothing without a path)."""
    if not path:
        return
    from sgl_kvxfer.fusedkv.curve import plot

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    plot(report, os.path.splitext(path)[0] + ".png")


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(0)
    import platform

    return platform.processor() or "cpu"


if __name__ == "__main__":
    main()
