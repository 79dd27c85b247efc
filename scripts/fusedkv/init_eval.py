"""Step 0 of a FusedKV retrofit, per init: the KV / attention-output fit errors and the held-out
PPL before any training, side by side on the same windows.

    python scripts/fusedkv/init_eval.py --data-dir .cache/fusedkv [--model DIR] [--device cpu]
        [--seq 128] [--calib-windows 32] [--eval-windows 8] [--sources 9,11] [--out R.json]

inits: `channel_lstsq` (per-channel / per-pair real least squares of the fusion weights alone),
`closed_form_pass1` (rotation-aware key fit folded into q_proj, value weights by ALS),
`closed_form` (pass 1, then o_proj refitted to the teacher's attention output), and
`channel_lstsq+o_proj` (the ablation: o_proj refitted over the per-channel fit). Sources: the
search's pair (retrofit.py), or --sources.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from sgl_kvxfer.fusedkv import curve as curves
from sgl_kvxfer.fusedkv.checkpoint import load_lm
from sgl_kvxfer.fusedkv.closed_form import fit_fusion_and_queries, fit_output_projections
from sgl_kvxfer.fusedkv.data import Tokenized, chunks, mixed_chunks, resolve_data_dir
from sgl_kvxfer.fusedkv.distill import lstsq_fusion_init, source_search
from sgl_kvxfer.fusedkv.retrofit import RetrofitConfig, autocast_for, spaced, student_from
from sgl_kvxfer.models.loader import resolve_model_path


def _mean(d: dict, key: str) -> float:
    return sum(v[key] for v in d.values()) / len(d)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--calib-windows", type=int, default=32)
    ap.add_argument("--eval-windows", type=int, default=8)
    ap.add_argument("--sources", default=None, help="s0,s1 (default: the source search)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--sequential", action="store_true", help="also the sequential o_proj fits (slow on CPU)")
    ap.add_argument("--skip-baselines", action="store_true", help="no channel_lstsq rows")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    model_dir = resolve_model_path(a.model)
    data = Tokenized(resolve_data_dir(a.data_dir), model_dir)
    autocast = autocast_for(a.device)
    teacher = load_lm(model_dir, a.device)
    teacher.requires_grad_(False)
    evals = {d: spaced(chunks(t, a.seq), a.eval_windows) for d, t in data.split("eval").items()}
    calib = mixed_chunks(data.split("calib"), a.seq, a.calib_windows)
    n = teacher.config.num_layers // 2
    rep = {"model": model_dir, "seq": a.seq, "calib_windows": int(calib.shape[0]), "calib_tokens": int(calib[:, 1:].numel()),
           "eval_tokens": {d: int(w[:, 1:].numel()) for d, w in evals.items()}}
    rep["teacher_ppl"] = curves.domain_ppl(teacher, evals, a.batch, autocast)
    if a.sources:
        sources = tuple(int(x) for x in a.sources.split(","))
    else:
        found = source_search(teacher, calib, a.batch, autocast, n, "fusedkv")
        sources = tuple(found["sources"])
    rep["sources"] = list(sources)
    cfg = RetrofitConfig(variant="fusedkv")
    rows = {}

    def measure(name, student, fit, t0):
        rows[name] = {"fit_s": time.perf_counter() - t0, "ppl": curves.domain_ppl(student, evals, a.batch, autocast),
                      "per_layer": fit}
        for key in ("k_rel_sq_err", "v_rel_sq_err", "o_rel_sq_err_before", "o_rel_sq_err"):
            if fit and key in next(iter(fit.values())):
                rows[name]["mean_" + key] = _mean(fit, key)
        ppl = ", ".join(f"{d} {p:.2f} ({100 * (p / rep['teacher_ppl'][d] - 1):+.1f}%)" for d, p in rows[name]["ppl"].items())
        errs = ", ".join(f"{k[5:]} {v:.3f}" for k, v in rows[name].items() if k.startswith("mean_"))
        print(f"{name:28s} PPL {ppl}; {errs}", flush=True)

    if not a.skip_baselines:
        t0 = time.perf_counter()
        s = student_from(teacher, cfg, sources)
        measure("channel_lstsq", s, lstsq_fusion_init(teacher, s, calib, a.batch, autocast), t0)
    t0 = time.perf_counter()
    s = student_from(teacher, cfg, sources)
    first = fit_fusion_and_queries(teacher, s, calib, a.batch, autocast)
    measure("closed_form_pass1", s, first, t0)
    t0 = time.perf_counter()
    measure("closed_form", s, {i: {**first[i], **v} for i, v in
                               fit_output_projections(teacher, s, calib, a.batch, autocast).items()}, t0)
    for mode in ((True,) if a.sequential else ()):
        t0 = time.perf_counter()
        s2 = student_from(teacher, cfg, sources)
        fit2 = fit_fusion_and_queries(teacher, s2, calib, a.batch, autocast)
        measure(f"closed_form[sequential={mode}]", s2, {i: {**fit2[i], **v} for i, v in fit_output_projections(
            teacher, s2, calib, a.batch, autocast, sequential=mode).items()}, t0)
    if not a.skip_baselines:
        t0 = time.perf_counter()
        s = student_from(teacher, cfg, sources)
        fit = lstsq_fusion_init(teacher, s, calib, a.batch, autocast)
        measure("channel_lstsq+o_proj", s, {i: {**fit[i], **v} for i, v in
                                            fit_output_projections(teacher, s, calib, a.batch, autocast).items()}, t0)
    rep["inits"] = rows
    print("teacher PPL " + ", ".join(f"{d} {p:.3f}" for d, p in rep["teacher_ppl"].items()) +
          f"; sources {sources}; calib {rep['calib_tokens']} tokens, eval {rep['eval_tokens']} tokens", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rep, f, indent=2)
    return rep


if __name__ == "__main__":
    main()
