"""Markdown tables of a FusedKV GPU run's JSONs (scripts/gpu/fusedkv_all.sh), for the docs.

    python scripts/fusedkv/results_tables.py DIR      # DIR: where the JSONs are (e.g. benchmarks/results)
    python scripts/fusedkv/results_tables.py FILE...  # named JSONs only

Prints, for each JSON found (every device's file in DIR) or named: the retrofit's curve and extrapolation, the from-scratch summary over
seeds, tiers (PPL, bytes, TPOT), serving TPOT with spread and bytes check, capacity. Every number
printed is read from the files; nothing is computed beyond ratios.
"""
from __future__ import annotations

import fnmatch
import glob
import json
import os
import sys


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f) | {"_file": os.path.basename(path)}


def retrofit(r: dict) -> list[str]:
    out = [f"**Retrofit** (`{r['_file']}`, {r['device']}, sources {r['fusedkv']['source_layers']}, "
           f"{r['train_gpu_s'] / 60:.2f} training GPU-minutes, {r['tokens_seen']:,} tokens, {r['epochs']:.2f} epochs)", "",
           "| point | GPU-min | " + " | ".join(f"{d} PPL" for d in sorted(r["teacher_ppl"])) + " |",
           "|---|---|" + "---|" * len(r["teacher_ppl"]),
           "| original | | " + " | ".join(f"{r['teacher_ppl'][d]:.3f}" for d in sorted(r["teacher_ppl"])) + " |"]
    for p in r["curve"]:
        cells = " | ".join(f"{p['ppl'][d]:.3f} ({100 * (p['ppl'][d] / r['teacher_ppl'][d] - 1):+.1f}%)"
                           for d in sorted(r["teacher_ppl"]))
        out.append(f"| {p['phase']} {p['step']} | {p['gpu_min']:.2f} | {cells} |")
    for d, e in sorted(r["extrapolation"].items()):
        fit = e.get("fit")
        out.append(f"- {d}: target x{e['target_ratio']}; " + (
            f"fit A={fit['A']:.3f}, alpha={fit['alpha']:.3f} over {e['points']} points, target "
            + (f"at {e['minutes_to_target']:.1f} GPU-minutes" if e.get("minutes_to_target") is not None
               else f"beyond {e.get('beyond_minutes', 0):.0e} GPU-minutes")
            if fit else f"no falling fit over {e['points']} points"))
    return out


def scratch(r: dict) -> list[str]:
    cap = f", budget-capped from {r.get('planned_steps')}" if r.get("budget_capped") else ""
    out = [f"**From scratch** (`{r['_file']}`, {r['device']}, {r['steps']} steps{cap} x {r['tokens_per_step']} tokens, "
           f"{r['workers']} workers)", "", "| run | final val loss mean | std | min..max | seeds | params |",
           "|---|---|---|---|---|---|"]
    for n, s in r["summary"].items():
        out.append(f"| {n} | {s['mean']:.4f} | {s['std']:.4f} | {s['min']:.4f}..{s['max']:.4f} | {len(s['seeds'])} | "
                   f"{s['params_total']:,} |")
    out.append(f"- comparisons: {json.dumps(r['comparisons'])}")
    if r.get("audit"):
        out.append(f"- STEP AUDIT FAILED: {r['audit']} (not a result)")
    return out


def tiers(r: dict) -> list[str]:
    out = [f"**Tiers** (`{r['_file']}`, {r['device']})", "",
           "| model | b | resident vs vanilla fp16 | PPL | TPOT ms (min..max) |", "|---|---|---|---|---|"]
    for x in r["rows"]:
        d = x.get("decode") or {}
        s = d.get("step_spread_s") or {}
        tp = f"{d['tpot_s'] * 1e3:.2f} ({s['min'] * 1e3:.2f}..{s['max'] * 1e3:.2f})" if d.get("tpot_s") else "-"
        out.append(f"| {x['model']} | {x['kv_tier_budget']:g} | {x['resident_vs_vanilla_fp16']:.3f}x | {x['ppl']:.3f} | {tp} |")
    return out


def serve(r: dict) -> list[str]:
    if "copy_bandwidth_Bps" not in r:  # older format: no bytes check, its TPOT is not a warm measurement
        return [f"**Serving** (`{r['_file']}`, {r['device']}, older format: pool and TTFT only)", ""] + [
            f"- {v}: pool {rel['pool']:.3f}x, TTFT {rel['ttft']}" for v, rel in r["vs_vanilla"].items()]
    out = [f"**Serving** (`{r['_file']}`, {r['device']}, copy {r['copy_bandwidth_Bps'] / 1e9:.0f} GB/s"
           + (", partial" if r.get("partial") else "") + ")", "",
           "| variant | point | TPOT ms | min..max | bytes allow >= ms | flag |", "|---|---|---|---|---|---|"]
    for v, row in r["rows"].items():
        if not row.get("complete", True):
            out.append(f"| {v} | incomplete: {len(row.get('tpot', []))} points | | | | |")
        for p in row.get("tpot", []):
            if "skipped" in p:
                out.append(f"| {v} | {p['batch']}x{p['context']} | skipped: {p['skipped']} | | | |")
                continue
            s = p["step_spread_s"]
            tp = f"{p['tpot_s'] * 1e3:.2f}" if p["tpot_s"] else "unmeasurable"
            out.append(f"| {v} | {p['batch']}x{p['context']} | {tp} | {s['min'] * 1e3:.2f}..{s['max'] * 1e3:.2f} | "
                       f"{p['min_step_s'] * 1e3:.2f} | {'FASTER THAN BYTES' if p['faster_than_bytes_allow'] else ''} |")
    for v, rel in r["vs_vanilla"].items():
        out.append(f"- {v}: pool {rel['pool_bytes_per_token']:.3f}x, TTFT {rel['ttft']}, TPOT {rel['tpot']}")
    return out


def capacity(r: dict) -> list[str]:
    out = [f"**Capacity** (`{r['_file']}`, {r['device']}, {r['params']['context']}-token requests)", "",
           "| variant | pool tokens | planned | held | decode step ms (min..max) | tok/s |", "|---|---|---|---|---|---|"]
    for v, x in r["rows"].items():
        s = x.get("step_spread_s") or {}
        out.append(f"| {v} | {x.get('pool_tokens')} | {x.get('planned')} | {x.get('held')} | "
                   f"{s.get('median', 0) * 1e3:.1f} ({s.get('min', 0) * 1e3:.1f}..{s.get('max', 0) * 1e3:.1f}) | "
                   f"{x.get('decode_tok_s') or 0:.1f} |")
    for v, rel in r["vs_vanilla"].items():
        out.append(f"- {v}: held {rel['held']:.2f}x, decode throughput {rel['decode_throughput']}, "
                   f"bytes predict {rel['bytes_model_throughput_ratio']:.2f}x")
    return out


def main() -> None:
    args = sys.argv[1:] or ["benchmarks/results"]
    for pattern, fn in (("fusedkv_retrofit*.json", retrofit), ("fusedkv_scratch_*.json", scratch),
                        ("fusedkv_tiers_*.json", tiers), ("fusedkv_serve_*.json", serve),
                        ("fusedkv_capacity_*.json", capacity)):
        for a in args:
            paths = (sorted(glob.glob(os.path.join(a, pattern))) if os.path.isdir(a)
                     else [a] if fnmatch.fnmatch(os.path.basename(a), pattern) else [])
            for p in paths:
                print("\n".join(fn(_load(p))) + "\n")


if __name__ == "__main__":
    main()
