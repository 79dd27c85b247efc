"""The paper's comparison at small scale: cross-layer KV layouts trained from scratch, several seeds.

    python scripts/fusedkv/compare_scratch.py --data-dir .cache/fusedkv --device cuda \\
        --runs vanilla fusedkv lite cla2 yoco --seeds 0 1 2 --workers 3 --time-budget-s 70
    python scripts/fusedkv/compare_scratch.py --data-dir DIR --preset toy --device cpu --seeds 0 --workers 1

Every run is sgl_kvxfer/fusedkv/scratch.py's `train_run` (equal parameters within a few hundred,
equal KV bytes for every sharing layout, the same tokens in the same order). A run name is a
layout, or fusedkv with options: `fusedkv[init=lite]` (fusion weights start as Lite),
`fusedkv[fusion_lr=x30]` (their learning rate 30x the rest). `--workers` processes share the
device, each training its share of the grid (seed-major, so a cut-off run keeps whole seeds); they
first time a few steps together, and the parent sets one step count for every run so that the grid
fits --time-budget-s. Output: fusedkv_scratch_<preset>_<device>.json (every run's curves and
final losses, the per-layout mean / std / min / max over seeds, the comparisons) and a PNG of the
validation curves (mean, min-max band) and the final losses per seed. Written after every run, so
an interrupted grid keeps what finished.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

DEFAULT_RUNS = ("vanilla", "fusedkv", "lite", "cla2", "yoco")


def load_data(args):
    """(vocab, train windows, eval subset, {domain: eval windows}) for the preset."""
    import torch

    from sgl_kvxfer.fusedkv.data import Tokenized, chunks, mixed_chunks, resolve_data_dir
    from sgl_kvxfer.fusedkv.scratch import PRESETS
    from sgl_kvxfer.models.loader import resolve_model_path

    p = PRESETS[args.preset]
    tok_dir = resolve_model_path(args.tokenizer)
    data = Tokenized(resolve_data_dir(args.data_dir), tok_dir)
    with open(os.path.join(tok_dir, "config.json")) as f:
        vocab = int(json.load(f)["vocab_size"])
    cap = 64 if args.preset == "toy" else None
    train = mixed_chunks(data.split("train"), p["seq"], cap)
    doms = {d: chunks(t, p["seq"], 8 if args.preset == "toy" else None) for d, t in data.split("eval").items()}
    full = torch.cat(list(doms.values()))
    g = torch.Generator().manual_seed(1)
    sub = full[torch.randperm(full.shape[0], generator=g)[: p["eval_windows"]]]
    return vocab, train, sub, doms


def worker(args) -> None:
    """Probe together with the other workers, read the step count, train the assigned runs.
    Talks JSON lines: out {"probe": ...} then {"result": ...} per run; in {"steps": n}."""
    import torch

    from sgl_kvxfer.fusedkv.scratch import PRESETS, RunSpec, autocast_for, build, evaluate, probe_step_s, train_run

    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
    p = PRESETS[args.preset]
    vocab, train, sub, doms = load_data(args)
    step_s = probe_step_s(p, vocab, train, args.device)
    t0 = time.perf_counter()
    m = build(RunSpec("vanilla"), p, vocab).to(args.device)
    evaluate(m, sub, p["batch"], args.device, autocast_for(args.device))
    eval_sub_s = time.perf_counter() - t0
    del m
    print(json.dumps({"probe": {"step_s": step_s, "eval_sub_s": eval_sub_s,
                                "eval_full_windows": sum(w.shape[0] for w in doms.values())}}), flush=True)
    steps = json.loads(sys.stdin.readline())["steps"]
    for text, seed in json.loads(args.assign):
        r = train_run(RunSpec.parse(text, seed), p, vocab, steps, train, sub, doms, args.device)
        print(json.dumps({"result": r}), flush=True)


def plan_steps(probes: list[dict], p: dict, runs_per_worker: int, budget_s: float, elapsed_s: float) -> int:
    """One step count for every run: the preset's, or fewer so the slowest worker's share fits."""
    step_s = max(q["step_s"] for q in probes)
    eval_sub = max(q["eval_sub_s"] for q in probes)
    full = eval_sub * max(q["eval_full_windows"] for q in probes) / p["eval_windows"]
    per_run_fixed = (p["eval_points"] + 1) * eval_sub + full + 1.0  # evals + build
    if not budget_s:
        return p["steps"]
    left = budget_s - elapsed_s
    afford = int((left / runs_per_worker - per_run_fixed) / step_s)
    return max(1, min(p["steps"], afford))


def summarize(results: list[dict]) -> dict:
    """Per run name: final validation loss over seeds (mean / std / min / max) and curve stats."""
    groups: dict[str, list[dict]] = {}
    for r in results:
        groups.setdefault(r["name"], []).append(r)
    out = {}
    for name, rs in groups.items():
        finals = [r["final_val_loss"] for r in rs]
        steps = rs[0]["val_steps"]
        curves = [r["val_loss"] for r in rs if r["val_steps"] == steps]
        out[name] = {"seeds": [r["spec"]["seed"] for r in rs], "final_val_loss": finals,
                     "mean": statistics.fmean(finals), "std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
                     "min": min(finals), "max": max(finals),
                     "by_domain_mean": {d: statistics.fmean(r["final_val_loss_by_domain"][d] for r in rs)
                                        for d in rs[0]["final_val_loss_by_domain"]},
                     "val_steps": steps,
                     "val_mean": [statistics.fmean(c[i] for c in curves) for i in range(len(steps))],
                     "val_min": [min(c[i] for c in curves) for i in range(len(steps))],
                     "val_max": [max(c[i] for c in curves) for i in range(len(steps))],
                     "params_total": rs[0]["params"]["total"], "kv_bytes_per_token_bf16": rs[0]["kv_bytes_per_token_bf16"]}
    return out


def comparisons(summary: dict) -> dict:
    """Differences of means against vanilla, and FusedKV against Lite (negative: lower loss)."""
    out = {}
    if "vanilla" in summary:
        v = summary["vanilla"]["mean"]
        out["minus_vanilla"] = {n: s["mean"] - v for n, s in summary.items() if n != "vanilla"}
        if "fusedkv" in summary:
            out["fusedkv_le_vanilla"] = summary["fusedkv"]["mean"] <= v
    if "fusedkv" in summary and "lite" in summary:
        out["fusedkv_minus_lite"] = summary["fusedkv"]["mean"] - summary["lite"]["mean"]
    return out


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    tok = res["tokens_per_step"] / 1e6
    names = list(res["summary"])
    for i, n in enumerate(names):
        s = res["summary"][n]
        xs = [k * tok for k in s["val_steps"]]
        ax[0].plot(xs, s["val_mean"], color=f"C{i}", label=f"{n} (n={len(s['seeds'])})")
        ax[0].fill_between(xs, s["val_min"], s["val_max"], color=f"C{i}", alpha=0.2)
        ax[1].scatter([i] * len(s["final_val_loss"]), s["final_val_loss"], color=f"C{i}", s=18)
        ax[1].errorbar([i], [s["mean"]], yerr=[[s["mean"] - s["min"]], [s["max"] - s["mean"]]], fmt="_",
                       color="k", capsize=6, ms=14)
    lo = min(min(s["val_min"][-1:] or [9]) for s in res["summary"].values())
    ax[0].set_ylim(lo - 0.1, lo + 1.2)
    ax[0].set(xlabel="train tokens (M)", ylabel="validation loss (eval subset)",
              title="validation loss: mean over seeds, band = min..max")
    ax[1].set_xticks(range(len(names)), names, rotation=25, ha="right", fontsize=8)
    ax[1].set(ylabel="final validation loss (whole eval split)", title="per seed (dots), mean and range")
    for a in ax:
        a.grid(alpha=0.3)
    ax[0].legend(fontsize=7)
    fig.suptitle(f"cross-layer KV layouts from scratch at equal KV bytes, {res['device']}, "
                 f"{res['steps']} steps x {res['tokens_per_step']} tokens", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parent(args) -> str:
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from common.report import device_name, write_json

    from sgl_kvxfer.fusedkv.scratch import PRESETS, RunSpec

    t_start = time.perf_counter()
    p = PRESETS[args.preset]
    grid = [(text, seed) for seed in args.seeds for text in args.runs]
    for text, seed in grid:
        RunSpec.parse(text, seed)  # bad names fail here, before any worker starts
    w = max(1, min(args.workers, len(grid)))
    shares = [grid[i::w] for i in range(w)]
    base = [sys.executable, os.path.abspath(__file__), "--worker", "--preset", args.preset, "--device", args.device]
    for flag, value in (("--data-dir", args.data_dir), ("--tokenizer", args.tokenizer)):
        if value:
            base += [flag, value]
    procs = [subprocess.Popen(base + ["--assign", json.dumps(s)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, cwd=ROOT) for s in shares]
    name = f"fusedkv_scratch_{args.preset}_{'cuda' if args.device.startswith('cuda') else 'cpu'}"
    res = {"device": device_name(args.device), "preset": args.preset, "config": p, "runs": args.runs,
           "seeds": args.seeds, "workers": w, "time_budget_s": args.time_budget_s,
           "tokens_per_step": p["batch"] * p["seq"], "results": [], "partial": True}

    def save() -> str:
        res["summary"] = summarize(res["results"]) if res["results"] else {}
        res["comparisons"] = comparisons(res["summary"])
        path = write_json(name, res, args.out_dir)
        if res["results"]:
            plot(res, path[:-5] + ".png")
        return path

    def read(proc) -> dict | None:
        for line in proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        return None

    path = None
    try:
        probes = [read(q) for q in procs]
        if any(q is None or "probe" not in q for q in probes):
            raise RuntimeError(f"a worker failed before its probe: {probes}")
        probes = [q["probe"] for q in probes]
        steps = plan_steps(probes, p, max(len(s) for s in shares), args.time_budget_s, time.perf_counter() - t_start)
        res.update(probes=probes, steps=steps, planned_steps=p["steps"], budget_capped=steps < p["steps"])
        print(f"{len(grid)} runs on {w} workers, {steps} steps each (preset {p['steps']}); "
              f"probe {max(q['step_s'] for q in probes) * 1e3:.0f} ms/step", flush=True)
        for q in procs:
            q.stdin.write(json.dumps({"steps": steps}) + "\n")
            q.stdin.flush()
        live = list(procs)
        while live:
            for q in list(live):
                msg = read(q)
                if msg is None:
                    live.remove(q)
                    continue
                r = msg["result"]
                res["results"].append(r)
                print(f"{r['name']} seed {r['spec']['seed']}: final val {r['final_val_loss']:.4f} "
                      f"{ {d: round(x, 4) for d, x in r['final_val_loss_by_domain'].items()} }, {r['train_s']:.1f} s",
                      flush=True)
                path = save()
        res["partial"] = len(res["results"]) < len(grid)
    except KeyboardInterrupt:
        print("interrupted: writing the runs that finished", flush=True)
    finally:
        for q in procs:
            if q.poll() is None:
                q.send_signal(signal.SIGINT)
        for q in procs:
            try:
                q.wait(timeout=10)
            except subprocess.TimeoutExpired:
                q.kill()
    path = save()
    for n, s in res["summary"].items():
        print(f"{n:28s} final val loss mean {s['mean']:.4f} (std {s['std']:.4f}, {s['min']:.4f}..{s['max']:.4f}, "
              f"n={len(s['seeds'])})", flush=True)
    print(json.dumps(res["comparisons"]), flush=True)
    print("wrote", path, flush=True)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    from sgl_kvxfer.fusedkv.scratch import PRESETS

    ap.add_argument("--preset", choices=sorted(PRESETS), default="small")
    ap.add_argument("--runs", nargs="+", default=list(DEFAULT_RUNS), help="layouts, or fusedkv[init=...,fusion_lr=xN]")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--workers", type=int, default=1, help="processes sharing the device")
    ap.add_argument("--time-budget-s", type=float, default=0.0, help="the whole grid (0: the preset's steps)")
    ap.add_argument("--data-dir", default=None, help="token or jsonl folder (default: $SGL_KVXFER_FUSEDKV_DATA)")
    ap.add_argument("--tokenizer", default=None, help="model dir whose tokenizer and vocab the models use "
                    "(default: the embedded SmolLM2)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--assign", default="[]", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if not 1 <= args.workers <= 16 or not 0 <= args.time_budget_s < 1e6:
        ap.error("--workers in [1, 16], --time-budget-s in [0, 1e6)")
    if args.worker:
        signal.signal(signal.SIGINT, lambda *a: sys.exit(130))
        return worker(args)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return parent(args)


if __name__ == "__main__":
    main()
