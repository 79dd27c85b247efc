"""The paper's comparison at small scale: cross-layer KV layouts trained from scratch, several seeds.

    python scripts/fusedkv/compare_scratch.py --data-dir .cache/fusedkv --device cuda \\
        --runs vanilla fusedkv lite cla2 yoco --seeds 0 1 2 --workers 3 --time-budget-s 70
    python scripts/fusedkv/compare_scratch.py --data-dir DIR --preset toy --device cpu --seeds 0 --workers 1

Every run is sgl_kvxfer/fusedkv/scratch.py's `train_run` (equal parameters within a few hundred,
equal KV bytes for every sharing layout, the same tokens in the same order). A run name is a
layout, or fusedkv with options: `fusedkv[init=lite]` (fusion weights start as Lite),
`fusedkv[fusion_lr=x30]` (their learning rate 30x the rest). `--workers` processes share the
device, each training its share of the grid (seed-major, so a cut-off run keeps whole seeds); once
all have loaded the data they time a few training steps and a warm evaluation together, and the
parent sets one step count for every run so that the grid fits --time-budget-s: the preset's
`steps`, or fewer, never under `--min-steps` (the preset's `min_steps`). `plan` in the JSON holds
the inputs; `budget_capped` says the count is under the preset's. Output:
fusedkv_scratch_<preset>_<device>.json (<device>: the GPU's name, or cpu; every run's curves and final losses, the per-layout
mean / std / min / max over seeds, the comparisons) and a PNG of the validation curves (mean,
min-max band) and the final losses per seed. Written after every run, so an interrupted grid keeps
what finished. `audit` lists what is wrong with the step counts (a run of <= 1 step, under the
floor, or under the preset's count without `budget_capped`); a non-empty audit exits with status 3.
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
    """(vocab, train windows, eval subset, {domain: eval windows}) for the preset. A token folder
    (meta.json with vocab_size) needs no tokenizer unless --tokenizer names one: the GPU machine
    runs the grid without any model directory."""
    import torch

    from sgl_kvxfer.fusedkv.data import Tokenized, chunks, is_token_folder, mixed_chunks, resolve_data_dir
    from sgl_kvxfer.fusedkv.scratch import PRESETS

    p = PRESETS[args.preset]
    data_dir = resolve_data_dir(args.data_dir)
    if args.tokenizer is None and is_token_folder(data_dir):
        data = Tokenized(data_dir, None)
    else:
        from sgl_kvxfer.models.loader import resolve_model_path

        data = Tokenized(data_dir, resolve_model_path(args.tokenizer))
    cap = 64 if args.preset == "toy" else None
    train = mixed_chunks(data.split("train"), p["seq"], cap)
    doms = {d: chunks(t, p["seq"], 8 if args.preset == "toy" else None) for d, t in data.split("eval").items()}
    full = torch.cat(list(doms.values()))
    g = torch.Generator().manual_seed(1)
    sub = full[torch.randperm(full.shape[0], generator=g)[: p["eval_windows"]]]
    return data.vocab_size, train, sub, doms


def worker(args) -> None:
    """Load the data, wait for every worker, probe together, read the step count, train the
    assigned runs. Talks JSON lines: out {"ready": ...}, {"probe": ...}, then {"result": ...} per
    run; in {"go": true}, then {"steps": n}."""
    import torch

    from sgl_kvxfer.fusedkv.scratch import PRESETS, RunSpec, autocast_for, build, evaluate, probe_step_s, train_run

    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
    p = PRESETS[args.preset]
    vocab, train, sub, doms = load_data(args)
    print(json.dumps({"ready": {"vocab": vocab, "train_windows": train.shape[0]}}), flush=True)
    json.loads(sys.stdin.readline())  # {"go": true}: every worker probes at once, as they will train
    step_s = probe_step_s(p, vocab, train, args.device)
    m = build(RunSpec("vanilla"), p, vocab).to(args.device)
    autocast = autocast_for(args.device)
    evaluate(m, sub, p["batch"], args.device, autocast)  # untimed: the first eval pays kernel selection
    t0 = time.perf_counter()
    evaluate(m, sub, p["batch"], args.device, autocast)
    eval_sub_s = time.perf_counter() - t0
    del m
    print(json.dumps({"probe": {"step_s": step_s, "eval_sub_s": eval_sub_s,
                                "eval_full_windows": sum(w.shape[0] for w in doms.values())}}), flush=True)
    steps = json.loads(sys.stdin.readline())["steps"]
    for text, seed in json.loads(args.assign):
        r = train_run(RunSpec.parse(text, seed), p, vocab, steps, train, sub, doms, args.device)
        print(json.dumps({"result": r}), flush=True)


def plan_steps(probes: list[dict], p: dict, runs_per_worker: int, budget_s: float, elapsed_s: float,
               min_steps: int) -> dict:
    """One step count for every run: the preset's, or fewer so the slowest worker's share fits the
    budget, never fewer than min_steps (a grid of barely trained models compares nothing; past the
    budget the stage's timeout keeps the runs that finished). Returns the plan with its inputs."""
    step_s = max(q["step_s"] for q in probes)
    eval_sub = max(q["eval_sub_s"] for q in probes)
    full = eval_sub * max(q["eval_full_windows"] for q in probes) / p["eval_windows"]
    per_run_fixed = (p["eval_points"] + 1) * eval_sub + full + 1.0  # evals + build
    plan = {"planned_steps": p["steps"], "min_steps": min_steps, "step_s": step_s, "per_run_fixed_s": per_run_fixed,
            "runs_per_worker": runs_per_worker, "budget_s": budget_s, "elapsed_at_plan_s": elapsed_s}
    if not budget_s:
        return plan | {"steps": p["steps"], "afforded_steps": None, "budget_capped": False, "over_budget": False}
    afford = int(((budget_s - elapsed_s) / runs_per_worker - per_run_fixed) / step_s)
    steps = max(min(min_steps, p["steps"]), min(p["steps"], afford))
    return plan | {"steps": steps, "afforded_steps": afford, "budget_capped": steps < p["steps"],
                   "over_budget": afford < steps,
                   "expected_s": elapsed_s + runs_per_worker * (per_run_fixed + steps * step_s)}


def audit_steps(res: dict) -> list[str]:
    """What is wrong with the grid's step counts: a run that trained a different count than the
    plan, fewer steps than the preset without the plan saying it was capped, or a count that is
    no training at all (<= 1 step, or under the floor). Empty when all is well."""
    bad = []
    steps, planned = res.get("steps"), res.get("planned_steps")
    if steps is None:
        return ["no step plan"]
    if steps <= 1:
        bad.append(f"{steps} step(s) per run: nothing was trained")
    if steps < min(res.get("min_steps", 0), planned):
        bad.append(f"{steps} steps, under the floor of {res['min_steps']}")
    if steps < planned and not res.get("budget_capped"):
        bad.append(f"{steps} of {planned} planned steps without budget_capped")
    for r in res["results"]:
        ran = len(r["train_loss"])
        if r["steps"] != steps or ran != steps or (r["val_steps"] and r["val_steps"][-1] != steps):
            bad.append(f"{r['name']} seed {r['spec']['seed']}: trained {ran} steps, {steps} planned")
    return bad


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
    dev = device_name(args.device)
    # the device's name in the file name, as benchmarks/results keeps it (cpu on CPU)
    name = f"fusedkv_scratch_{args.preset}_{dev.split(' (')[0].replace(' ', '_') if args.device.startswith('cuda') else 'cpu'}"
    res = {"device": dev, "preset": args.preset, "config": p, "runs": args.runs,
           "seeds": args.seeds, "workers": w, "time_budget_s": args.time_budget_s,
           "tokens_per_step": p["batch"] * p["seq"], "results": [], "partial": True}

    def save() -> str:
        res["audit"] = audit_steps(res)
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
        ready = [read(q) for q in procs]
        if any(q is None or "ready" not in q for q in ready):
            raise RuntimeError(f"a worker failed before its probe: {ready}")
        for q in procs:
            q.stdin.write(json.dumps({"go": True}) + "\n")
            q.stdin.flush()
        probes = [read(q) for q in procs]
        if any(q is None or "probe" not in q for q in probes):
            raise RuntimeError(f"a worker failed in its probe: {probes}")
        probes = [q["probe"] for q in probes]
        plan = plan_steps(probes, p, max(len(s) for s in shares), args.time_budget_s,
                          time.perf_counter() - t_start, args.min_steps or p["min_steps"])
        steps = plan["steps"]
        res.update(probes=probes, plan=plan, steps=steps, planned_steps=p["steps"], min_steps=plan["min_steps"],
                   budget_capped=plan["budget_capped"])
        print(f"[{time.perf_counter() - t_start:6.1f} s] {len(grid)} runs on {w} workers, {steps} steps each "
              f"(preset {p['steps']}, floor {plan['min_steps']}); probe {plan['step_s'] * 1e3:.0f} ms/step, "
              f"evals {plan['per_run_fixed_s']:.1f} s per run"
              + (f"; expected {plan['expected_s']:.0f} s of the {args.time_budget_s:g} s budget"
                 if args.time_budget_s else ""), flush=True)
        if plan["budget_capped"]:
            print(f"budget capped: {steps} of the preset's {p['steps']} steps", flush=True)
        if plan["over_budget"]:
            print(f"WARNING: the budget affords {plan['afforded_steps']} steps per run; running the floor of "
                  f"{steps} (the stage's timeout keeps the runs that finish)", flush=True)
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
                print(f"[{time.perf_counter() - t_start:6.1f} s] {r['name']} seed {r['spec']['seed']}: "
                      f"{r['steps']} steps, final val {r['final_val_loss']:.4f} "
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
    if res["audit"]:
        print("STEP AUDIT FAILED: " + "; ".join(res["audit"]), file=sys.stderr, flush=True)
        sys.exit(3)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    from sgl_kvxfer.fusedkv.scratch import PRESETS

    ap.add_argument("--preset", choices=sorted(PRESETS), default="small")
    ap.add_argument("--runs", nargs="+", default=list(DEFAULT_RUNS), help="layouts, or fusedkv[init=...,fusion_lr=xN]")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--workers", type=int, default=1, help="processes sharing the device")
    ap.add_argument("--time-budget-s", type=float, default=0.0, help="the whole grid (0: the preset's steps)")
    ap.add_argument("--min-steps", type=int, default=0, help="the budget never cuts a run below this "
                    "(0: the preset's min_steps)")
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
    if not 1 <= args.workers <= 16 or not 0 <= args.time_budget_s < 1e6 or not 0 <= args.min_steps <= 10**6:
        ap.error("--workers in [1, 16], --time-budget-s in [0, 1e6), --min-steps in [0, 1e6]")
    if args.worker:
        signal.signal(signal.SIGINT, lambda *a: sys.exit(130))
        return worker(args)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return parent(args)


if __name__ == "__main__":
    main()
