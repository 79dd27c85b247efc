"""Continue training the Patch aligners of finished SCD artifacts, in a later process.

    python -m sgl_kvxfer.scd.calib.refine --artifacts ARTIFACTS --time-budget-s 500

A calibration's aligners stop on its time budget, their LR annealed. This command takes
the artifacts it wrote (manifest, tensors and calibration.json) and trains the same aligners on:
it loads the producer and consumers named in calibration.json's `config`, repeats the
calibration's second paired pass (`collect_h`, same calib data, same seed: the same sampled
tokens), encodes them with the artifacts' own H encoder as the wire delivers the codes, and
resumes every aligner from its saved parameters (warm start, a fresh cosine LR schedule over
the budget, peaking by default at a tenth of the calibration's LR: REFINE_LR_FRACTION). The
Reuse fits, the Patch layer set and the H encoders stay as they are; only the aligner tensors
change, and each keeps its best held-out check, so no aligner gets worse on
the held-out split than it was.

Invariant: the held-out split is the calibration's. train_aligners splits the sampled tokens by
its seed, and collect_h samples them by cfg.seed from cfg's calib data, aligner_tokens and
batch size; refine therefore reads all of these from calibration.json and offers no flag that
changes them (a different split would train on tokens the earlier pass held out).

The artifacts are rewritten in place (or into --out) at the calibration's storage dtype;
calibration.json gains a `refinements` entry per call (wall time, steps, held-out loss before
and after per aligner) and its `aligners` report is updated. --time-budget-s counts from the
process's start, as calibration's does; SIGINT (a `timeout -s INT` around the run) leaves the
artifacts untouched.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import tempfile
import time

import torch

from sgl_kvxfer.scd.artifacts import ScdArtifacts
from sgl_kvxfer.scd.calib import stages
from sgl_kvxfer.scd.calib.aligner import train_aligners
from sgl_kvxfer.scd.calib.budget import Budget, process_start
from sgl_kvxfer.scd.calib.calibrate import CalibConfig, StageTimer
from sgl_kvxfer.scd.codec import ALIGNER_PARAMS


# A refine call's default peak LR, as a fraction of the calibration's. The calibration's cosine
# ends at 0.05 of its peak; a warm restart at the full peak undoes that annealing: on SmolLM2
# specialists (H200) every one of 18 aligners stayed above its starting held-out loss for 2000
# steps and stopped on patience, unchanged. A restart near where the annealing ended continues it.
REFINE_LR_FRACTION = 0.1


def load_config(art_dir: str, device: str | None = None) -> CalibConfig:
    """The CalibConfig of the calibration that wrote `art_dir` (its calibration.json)."""
    path = os.path.join(art_dir, "calibration.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no calibration.json in {art_dir}: refine continues a calibration's artifacts")
    with open(path) as f:
        saved = json.load(f)["config"]
    fields = {f.name for f in dataclasses.fields(CalibConfig)}
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k in fields}
    if device:
        kwargs["device"] = device
    return CalibConfig(**kwargs)


def refine(art_dir: str, time_budget_s: float, out: str | None = None, lr: float | None = None,
           device: str | None = None, started: float | None = None, argv: list[str] | None = None) -> dict:
    """Trains the aligners of `art_dir` on for about time_budget_s (from `started`, default now)
    and writes the artifacts to `out` (default: art_dir). Returns the refinement record."""
    if not (0 < time_budget_s < 1e9):  # also refuses NaN and inf
        raise ValueError(f"--time-budget-s must be a finite number of seconds > 0, got {time_budget_s}")
    if lr is not None and not (0 < lr < 1e3):
        raise ValueError(f"--aligner-lr must be finite and > 0, got {lr}")
    cfg = load_config(art_dir, device)
    art = ScdArtifacts.load(art_dir)
    m = art.manifest
    patch = list(m.patch_layers)
    if not patch:
        raise ValueError(f"{art_dir} has no Patch layers: there are no aligners to refine")
    lr = lr or cfg.aligner_lr * REFINE_LR_FRACTION
    budget = Budget(time_budget_s, started=started)
    timer, t_start = StageTimer(), time.perf_counter()
    with timer("load"):
        env = stages.load_models(cfg)
    names = list(env.consumers)
    if tuple(names) != tuple(m.consumer_names):
        raise ValueError(f"calibration.json names consumers {names}, the manifest {list(m.consumer_names)}")
    with timer("data"):
        fit_chunks, sel_chunks = stages.calib_chunks(cfg, env.tokenizer)
    with timer("collect_h"):
        _, samples = stages.collect_h(cfg, env, fit_chunks, patch)
    # one stacked pass over every (layer, consumer) for a joint calibration, else layer by layer
    # with the calibration's per-layer seeds (each seed fixes that layer's held-out split)
    groups = [(patch, cfg.seed)] if cfg.aligner_joint else [([layer], cfg.seed + layer) for layer in patch]
    updated, record = dict(art.tensors), {"aligners": {}}
    with timer("train"):
        for j, (layers, seed) in enumerate(groups):
            left = budget.left()
            share = max(1e-6, left / (len(groups) - j)) if left is not None else 0.0
            zs, targets, inits, w_kvs, keys = [], [], [], [], []
            for layer in layers:
                # the artifacts' own (stored-dtype) encoder: the codes the aligners read when serving
                z = stages.h_codes(samples[layer][0], art.producer_tensor(f"h_mu.{layer}"),
                                   art.producer_tensor(f"h_enc.{layer}"), cfg.code_dtype)
                for i, name in enumerate(names):
                    zs.append(z)
                    targets.append(samples[layer][1 + i])
                    inits.append({p: art.consumer_tensor(name, f"a_{p}.{layer}").to(z.device) for p in ALIGNER_PARAMS})
                    w_kvs.append(stages.kv_rows(env, name, layer))
                    keys.append((name, layer))
            trained = train_aligners(zs, targets, [p["lin_w"] for p in inits], [p["lin_b"] for p in inits],
                                     inits[0]["w1"].shape[-1], cfg.aligner_steps, lr,
                                     cfg.aligner_batch, w_kvs=w_kvs, aux=cfg.aligner_aux, seed=seed,
                                     patience=cfg.aligner_patience, time_budget_s=share,
                                     h_weight=cfg.aligner_h_weight, init=inits)
            for (name, layer), (params, rep) in zip(keys, trained):
                for p, t in params.items():
                    updated[f"{name}/a_{p}.{layer}"] = t.detach().float().cpu()
                record["aligners"].setdefault(name, {})[str(layer)] = rep
    dest = out or art_dir
    with timer("save"):
        # written beside, then moved in file by file: an interrupted save leaves the old artifacts whole
        tmp = tempfile.mkdtemp(prefix=".refine.", dir=os.path.dirname(os.path.abspath(dest)))
        ScdArtifacts(m, updated).save(tmp, getattr(torch, cfg.storage_dtype))
    if m.level_agreement:  # measured with the old aligners: measure it again with the saved new ones
        with timer("level_agreement"):
            saved = ScdArtifacts.load(tmp)
            record["level_agreement"] = stages.level_agreement(env, saved, sel_chunks)
            saved.manifest = dataclasses.replace(m, level_agreement=tuple(record["level_agreement"]["agreement"]))
            saved.save_manifest(tmp)
    record.update({**stages.provenance(env.device, "sgl_kvxfer.scd.calib.refine", argv), "time_budget_s": time_budget_s, "lr": lr,
                   "wall_s": {**timer.wall, "total": round(time.perf_counter() - t_start, 3)}})
    _write_report(art_dir, tmp, record)
    os.makedirs(dest, exist_ok=True)
    for f in os.listdir(tmp):
        os.replace(os.path.join(tmp, f), os.path.join(dest, f))
    os.rmdir(tmp)
    if dest != art_dir:  # the rest of a calibration's output (reuse stats) goes with it
        for f in os.listdir(art_dir):
            if not os.path.exists(os.path.join(dest, f)) and os.path.isfile(os.path.join(art_dir, f)):
                shutil.copy2(os.path.join(art_dir, f), os.path.join(dest, f))
    worst = max(r["val_loss_best"] / max(r["val_loss_linear"], 1e-12)
                for per in record["aligners"].values() for r in per.values())
    print(f"[refine] {sum(len(v) for v in record['aligners'].values())} aligners, held-out loss at most "
          f"{worst:.3f}x of where this call started; {record['wall_s']['total']:.1f} s -> {dest}", flush=True)
    return record


def _write_report(art_dir: str, dest: str, record: dict) -> None:
    with open(os.path.join(art_dir, "calibration.json")) as f:
        report = json.load(f)
    report.setdefault("refinements", []).append(record)
    if "level_agreement" in record:  # the manifest's, with the refined aligners
        report["level_agreement"] = record["level_agreement"]
    for name, per in record["aligners"].items():  # the aligners' current state, with the earlier fields
        for layer, rep in per.items():
            old = report.get("aligners", {}).get(name, {}).get(layer, {})
            report.setdefault("aligners", {}).setdefault(name, {})[layer] = {
                **old, **{k: v for k, v in rep.items() if k != "val_loss_linear"},
                "val_loss_refine_start": rep["val_loss_linear"], "refined": len(report["refinements"])}
    with open(os.path.join(dest, "calibration.json"), "w") as f:
        json.dump(report, f, indent=1)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifacts", required=True, help="a calibration's output directory")
    ap.add_argument("--time-budget-s", type=float, required=True,
                    help="the whole process, from its start (the save keeps 10 s of it)")
    ap.add_argument("--out", default=None, help="write the refined artifacts here (default: in place)")
    ap.add_argument("--aligner-lr", type=float, default=None,
                    help="peak LR of this call (default: REFINE_LR_FRACTION, 0.1, of the calibration's)")
    ap.add_argument("--device", default=None, help="default: the calibration's")
    args = ap.parse_args(argv)
    try:
        refine(args.artifacts, args.time_budget_s, args.out, args.aligner_lr, args.device, started=process_start(),
               argv=argv)
    except KeyboardInterrupt:
        print("[refine] interrupted: the artifacts are unchanged", flush=True)
        raise SystemExit(130)


if __name__ == "__main__":
    main()
