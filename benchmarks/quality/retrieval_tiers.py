"""SpectrumKV on a retrieval test bed: one table at equal bytes per token, depth-by-budget heatmaps.

    python benchmarks/quality/retrieval_tiers.py --model DIR --device cuda        # the GPU run
    python benchmarks/quality/retrieval_tiers.py --quick --model DIR               # CPU smoke run
    python benchmarks/quality/retrieval_tiers.py --plot-only benchmarks/results/retrieval_tiers_<tag>.json

Everything runs through the engine (benchmarks/quality/README.md): an untiered engine (fp16) and,
per method and budget, a tiered engine started with that point's flags (torch attention backend;
--kv-tier-policy, --kv-tier-budget, --kv-recency-lambda, --kv-layer-budget profile, --kv-cold-tier),
so its pool is sized once for the point's own tier mix and formats, as a server with those flags
would be (no store fallbacks from a pool planned for another mix; `fallback_tokens` reports any).
Points that share an engine's flags but for lambda (greedy / spectrumkv) or the cold tier's
threshold share the engine; one tiered engine lives at a time.

Trials: the task suite's (`sgl_kvxfer/tasks`, default `kv`: key-value lines, one key asked)
eval split at `--context` tokens, the asked line at `--depths` evenly spaced depths,
`--trials-per-depth` items each, under the chat template; greedy decoding; exact match; the same
items for every method, so two rows compare trial by trial (the summary counts the trials only the
best SpectrumKV row or only random tiers answers). Every row has a 95% Wilson interval and, for kv
items, the lowest tier any token of each trial's asked line got at prefill (`needle_tier`, with
the accuracy within each tier): whether a policy kept the fact it is asked about.
`--resume JSON` continues an earlier call's results (same trials): its fp16 ceilings, profile,
lambda and threshold are reused and its measured points skipped, so one table may take two calls.
Stages, in order (the JSON is rewritten after every point, so a run cut short keeps what ran):

    1. fp16 accuracy at --context and --long-context (the test bed's own ceiling)
    2. the per-layer profile (spectrum_calib/layer_profile.py) on validation prompts: KL of the
       answer tokens; saved beside the results, used by the `per-layer` rows, and its most
       sensitive layers are the ones the cold tier scores (as --kv-layer-profile would pick them)
    3. validation (the `calib` split, random depths): the recency lambda of Eq. 13 for greedy, and
       the cold tier's promotion threshold, each picked by validation accuracy, never on eval
    4. the table: every method at every budget (bytes unit): accuracy by depth, compressed-prefix
       PPL on prose windows (ppl_sweep.py's protocol), byte ratio, tier mix, cold-tier counters

Methods: fp16, uniform-int8, uniform-int4, kivi, pdtrim, sws, random-tier, balanced,
adaptive-2tier, greedy (lambda 0), spectrumkv (greedy, tuned lambda), spectrumkv-max (spectrumkv
ranking by the per-head max of the window's attention, --kv-importance attn-max), per-layer (spectrumkv with
--kv-layer-budget profile), cold-tier (spectrumkv with --kv-cold-tier at the tuned threshold),
spectrumkv-torch (spectrumkv on the torch backend: per-layer's uniform control under --backend triton).

Backend (--backend): every engine runs on it (torch by default), except the methods whose per-layer
int formats only the torch kernels read (kivi, per-layer, and spectrumkv-torch by definition); each
row records its backend. A triton engine runs without CUDA graphs (a point decodes a few steps: a
capture per engine start would cost more than it saves). A method whose settings (engine flags,
backend, lambda, cold tier) equal an earlier row's at the same budget is not run again: the row
repeats that measurement and names it in `same_as` (greedy when the tuned lambda is 0,
spectrumkv-torch under --backend torch).
"""
from __future__ import annotations

import argparse
import math
import os
import time

from _harness import (add_common_args, device_tag, git_commit, load_for_plot, metadata, run_then_plot, save_plot,
                      tier_stats, write)

METHODS = ("uniform-int8", "uniform-int4", "kivi", "pdtrim", "sws", "random-tier", "balanced", "adaptive-2tier",
           "greedy", "spectrumkv", "spectrumkv-max", "spectrumkv-torch", "per-layer", "cold-tier")
TORCH_ONLY = ("kivi", "per-layer", "spectrumkv-torch")  # per-layer int formats: the torch kernels read them


def method_backend(method: str, backend: str) -> str:
    return "torch" if method in TORCH_ONLY else backend


def method_settings(method: str, lam: float, profile: str | None) -> tuple[dict, float, bool]:
    """(engine flags that fix the pool, recency lambda, cold tier on) of a table method."""
    if method == "greedy":
        return {"kv_tier_policy": "greedy"}, 0.0, False
    if method in ("spectrumkv", "spectrumkv-torch"):
        return {"kv_tier_policy": "greedy"}, lam, False
    if method == "spectrumkv-max":  # importance: the per-head max of the window's attention
        return {"kv_tier_policy": "greedy", "kv_importance": "attn-max"}, lam, False
    if method == "per-layer":
        return {"kv_tier_policy": "greedy", "kv_layer_budget": "profile", "kv_layer_profile": profile}, lam, False
    if method == "cold-tier":
        return {"kv_tier_policy": "greedy"}, lam, True
    return {"kv_tier_policy": method}, 0.0, False


# ---------------------------------------------------------------- trials


def build_trials(tok, task: str, split: str, context: int, depths, per_depth: int, seed: int, params: dict):
    from sgl_kvxfer import tasks

    trials = []
    for i, depth in enumerate(depths):
        for ex in tasks.generate(task, split, per_depth, seed=seed * 1000 + i, tokenizer=tok, context_tokens=context,
                                 depth=depth, **params):
            ids = tasks.chat_prompt_ids(tok, ex)
            trials.append({"example": ex, "depth": depth, "ids": ids, "span": needle_span(tok, ids, ex)})
    return trials


def needle_span(tok, ids: list[int], ex) -> tuple[int, int] | None:
    """Token positions [lo, hi) of the asked "KEY: VALUE" line of a kv item (None for other tasks
    or when the line cannot be found in the decoded pieces)."""
    if ex.task != "kv":
        return None
    line = f"{ex.question.split('key ')[-1].rstrip('?')}: {ex.answer}"
    ends, n = [], 0
    pieces = [tok.decode([i]) for i in ids]
    for p in pieces:
        n += len(p)
        ends.append(n)
    at = "".join(pieces).find(line)
    if at < 0:
        return None
    lo = next(i for i, e in enumerate(ends) if e > at)
    hi = next(i for i, e in enumerate(ends) if e >= at + len(line)) + 1
    return lo, hi


def needle_tiers(records, trials, tag: str) -> list[int | None]:
    """Per trial, the lowest precision (highest tier id) any token of its asked line got at prefill."""
    maps: dict[str, list] = {}
    for r in records:
        if r.tier_map is not None and r.rid.startswith(tag + "-"):
            maps.setdefault(r.rid, []).append(r)
    out = []
    for i, t in enumerate(trials):
        span, worst = t.get("span"), None
        for r in maps.get(f"{tag}-{i}", []) if span else []:
            lo, hi = max(span[0], r.start), min(span[1], r.end)
            if lo < hi:
                w = int(r.tier_map[lo - r.start:hi - r.start].max())
                worst = w if worst is None else max(worst, w)
        out.append(worst)
    return out


def needle_summary(worst: list, ok: list[bool]) -> dict:
    """Trials by the needle's worst tier (fp16, int8, int4, drop) and the accuracy within each."""
    counts, acc = [0] * 4, [None] * 4
    for t in range(4):
        hits = [o for w, o in zip(worst, ok) if w == t]
        counts[t] = len(hits)
        acc[t] = 100.0 * sum(hits) / len(hits) if hits else None
    return {"needle_tier_counts": counts, "acc_by_needle_tier": acc}


def wilson(k: int, n: int, z: float = 1.96) -> list[float]:
    """95% Wilson interval of k successes in n trials, in percent."""
    if n == 0:
        return [0.0, 100.0]
    p = k / n
    mid, half = (p + z * z / (2 * n)) / (1 + z * z / n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [100.0 * max(0.0, mid - half), 100.0 * min(1.0, mid + half)]


def run_trials(engine, trials, tag: str, max_new: int):
    from sgl_kvxfer import tasks

    engine.flush_cache()
    rids = [f"{tag}-{i}" for i in range(len(trials))]
    outs = engine.generate(input_ids=[t["ids"] for t in trials], rid=rids,
                           sampling_params={"max_new_tokens": max_new, "temperature": 0})
    ok = [bool(tasks.score(t["example"], o["text"])["em"]) for t, o in zip(trials, outs)]
    return ok, [o["text"] for o in outs], set(rids)


def by_depth(ok: list[bool], depths, per_depth: int) -> list[float]:
    return [100.0 * sum(ok[i * per_depth:(i + 1) * per_depth]) / per_depth for i in range(len(depths))]


# ---------------------------------------------------------------- stages


class Run:
    """One benchmark run: engines, trials, the results payload and its writer."""

    def __init__(self, args):
        from sgl_kvxfer import Engine

        self.args, self.t0 = args, time.time()
        self.kw = {"dtype": args.dtype, "device": args.device}
        if args.max_total_tokens:
            self.kw["max_total_tokens"] = args.max_total_tokens
        self.base = Engine(args.model, **self.kw, **self.backend_kw(args.backend))
        self.tiered, self.key = None, None  # the tiered engine of the current point and its flags
        self.started_s = 0.0  # the last engine start's seconds
        self.profile = None  # the layer profile's JSON: the cold tier probes its most int4-sensitive layers
        self.tok = self.base.tokenizer
        self.max_new = args.max_new_tokens
        self.rows, self.payload = [], {"engine_starts": []}
        self.name = f"retrieval_tiers_{device_tag(self.base)}{'_quick' if args.quick else ''}"

    @staticmethod
    def backend_kw(backend: str) -> dict:
        return {"attention_backend": backend, **({"disable_cuda_graph": True} if backend == "triton" else {})}

    def engine(self, flags: dict, budget: float, cold: bool, backend: str):
        """The tiered engine for these flags at `budget` (started here, the previous one shut down)."""
        from sgl_kvxfer import Engine

        args = self.args
        key = (tuple(sorted(flags.items())), budget, cold, backend)
        if key == self.key:
            return self.tiered
        if self.tiered is not None:
            self.tiered.shutdown()
            self.tiered = None
        t = time.time()
        kw = {**self.kw, **self.backend_kw(backend), **flags, "kv_tier_budget": budget, "kv_budget_unit": "bytes", "kv_int4": "on",
              "kv_tier_staging": 0.4}
        if args.kv_quant_group_size:
            kw["kv_quant_group_size"] = args.kv_quant_group_size
        if cold:
            kw.update(kv_cold_tier=True, kv_promote_threshold=args.cold_thresholds[0],
                      kv_promote_interval=args.promote_interval, kv_promote_radius=args.promote_radius,
                      kv_promote_layers=args.promote_layers, kv_cold_tier_tokens=args.cold_tier_tokens,
                      kv_promote_drop_run=args.promote_drop_run, kv_promote_max_tokens=args.promote_max_tokens)
            if self.profile is not None:
                kw["kv_layer_profile"] = self.profile
        self.tiered, self.key = Engine(args.model, **kw), key
        if cold:
            self.payload["probe_layers"] = self.tiered.scheduler.tiering.cold.layers
        self.payload["engine_starts"].append(round(time.time() - t, 2))
        self.started_s = time.time() - t
        return self.tiered

    def save(self, done: bool = False) -> str:
        self.payload.update(rows=self.rows, complete=done, wall_s=time.time() - self.t0)
        return write(self.args.out_dir, self.name, self.payload)

    def out_of_time(self) -> bool:
        return bool(self.args.time_budget_s) and time.time() - self.t0 > self.args.time_budget_s

    def point(self, trials, method: str, budget: float, lam: float, profile, threshold: float, tag: str) -> dict:
        flags, lam, cold = method_settings(method, lam, profile)
        self.started_s = 0.0
        engine = self.engine(flags, budget, cold, method_backend(method, self.args.backend))
        tiering = engine.scheduler.tiering
        tiering.configure(recency_lambda=lam)  # same formats: allowed at runtime
        manager = tiering.cold
        if manager is not None:
            manager.threshold = threshold
        before = dict(manager.stats) if manager is not None else None
        tiering.keep_tier_maps = True
        ok, texts, rids = run_trials(engine, trials, tag, self.max_new)
        info = engine.get_server_info()["extra"]
        stats = tier_stats(tiering.records, rids)
        stats["needle_tier"] = needle_tiers(tiering.records, trials, tag)
        delta = {k: manager.stats[k] - before[k] for k in ("promotions", "promoted_tokens", "promoted_bytes_h2d",
                                                           "restored_dropped", "restored_dropped_bytes_h2d",
                                                           "scoring_passes", "landed", "deferred", "no_room")} \
            if cold else None
        return {"ok": ok, "texts": texts, **stats, "cold": delta, "int_formats": info.get("kv_int_formats"),
                "layer_allocation": info.get("kv_layer_allocation"), "tier_slots": info.get("kv_tier_slots")}

    def ppl(self, windows, tag: str, point: tuple | None) -> dict:
        """PPL of the fp16 engine (point None) or of the tiered engine of (method, budget, lam, profile)."""
        from ppl_sweep import score

        if point is None:
            engine = self.base
        else:
            method, budget, lam, profile = point
            flags, lam, cold = method_settings(method, lam, profile)
            engine = self.engine(flags, budget, cold, method_backend(method, self.args.backend))
            engine.scheduler.tiering.configure(recency_lambda=lam)
        engine.flush_cache()
        nll, count, _, resident = score(engine, windows, self.args.ppl_context, tag)
        return {"ppl": math.exp(nll / count), "ppl_tokens": count, "resident_ratio": resident}

    def close(self) -> None:
        for engine in (self.base, self.tiered):
            if engine is not None:
                engine.shutdown()


def validate(run: Run, val, args) -> tuple[float, float]:
    """Stage 2: lambda (greedy) and the promotion threshold (cold tier) by validation accuracy."""
    sweep = [{"lambda": lam, "budgets": args.val_budgets, "accuracy": []} for lam in args.lambdas]
    for b in args.val_budgets:  # budget outer: one engine per budget, lambda set at runtime
        for entry in sweep:
            r = run.point(val, "spectrumkv", b, entry["lambda"], None, args.cold_thresholds[0],
                          f"val-l{entry['lambda']}-{b}")
            entry["accuracy"].append(100.0 * sum(r["ok"]) / len(r["ok"]))
            print(f"validation lambda {entry['lambda']:g} at b={b}: {entry['accuracy'][-1]:.1f}%", flush=True)
            run.payload["lambda_sweep"] = sweep
            run.save()
    best = max(sweep, key=lambda s: (sum(s["accuracy"]), -s["lambda"]))["lambda"]
    thr_sweep = []
    for thr in args.cold_thresholds:
        b = min(args.val_budgets)
        r = run.point(val, "cold-tier", b, best, None, thr, f"val-t{thr}")
        thr_sweep.append({"threshold": thr, "budget": b, "accuracy": 100.0 * sum(r["ok"]) / len(r["ok"]),
                          "promoted_tokens": r["cold"]["promoted_tokens"]})
        print(f"validation threshold {thr:g}: {thr_sweep[-1]}", flush=True)
        run.payload["threshold_sweep"] = thr_sweep
        run.save()
    threshold = max(thr_sweep, key=lambda s: (s["accuracy"], s["threshold"]))["threshold"]
    run.payload.update(chosen_lambda=best, chosen_threshold=threshold)
    run.save()
    return best, threshold


def layer_profile(run: Run, val, args) -> str:
    """Stage 3: the restore-one / lower-one profile on validation prompts (KL of the answers)."""
    import torch

    from sgl_kvxfer import tasks
    from sgl_kvxfer.models.loader import load_model
    from sgl_kvxfer.scd.calib.forward import LlamaRunner
    from sgl_kvxfer.spectrum_calib.layer_profile import profile_layers

    samples = []
    for t in val[:args.profile_samples]:
        ids, n_prompt = tasks.train_ids(run.tok, t["example"])
        samples.append((ids[:n_prompt - 1], ids[n_prompt - 1:]))
    runner = run.base.runner  # the tiered engines' group and page: the same config resolution
    group = args.kv_quant_group_size or runner.config.resolved_group_size(runner.arch.head_dim)
    model, _ = load_model(runner.model_dir, "auto", getattr(torch, args.dtype), runner.device, 0)
    t = time.time()
    prof = profile_layers(LlamaRunner(model), samples, group, runner.config.kv_tier_page_size, 4, args.profile_batch,
                          {"source": f"{args.task} validation answers", "context": args.context})
    del model
    path = os.path.join(args.out_dir, run.name.replace("retrieval_tiers", "layer_profile") + ".json")
    prof.save(path)
    top = sorted(range(prof.num_layers), key=lambda i: -prof.gain_up[i])[:6]
    run.payload["layer_profile"] = {"path": os.path.basename(path), "base_kl": prof.base_kl, "top_gain_layers": top,
                                    "gain_up": list(prof.gain_up), "loss_down": list(prof.loss_down),
                                    "wall_s": time.time() - t}
    print(f"layer profile: base KL {prof.base_kl:.4f}, most sensitive {top} ({time.time() - t:.1f} s)", flush=True)
    run.save()
    return path


def load_resume(args) -> dict:
    """The earlier call's payload, refused unless its trials are the ones this call builds."""
    import json

    with open(args.resume) as f:
        prev = json.load(f)
    same = ("task", "task_param", "context", "long_context", "depths", "trials_per_depth", "seed", "val_trials",
            "max_new_tokens", "backend", "ppl_windows", "ppl_context", "ppl_chunk")
    now = vars(args)
    diff = [k for k in same if k != "depths" and prev["params"].get(k) != now.get(k)]
    if len(prev["params"]["depths"]) != args.depths:
        diff.append("depths")
    if diff or "chosen_lambda" not in prev or "fp16" not in prev:
        raise SystemExit(f"--resume {args.resume}: differs in {diff} or has no validation / fp16 stage")
    return prev


def fp16_stage(r, trials, depths, windows, args, params) -> dict:
    """Stage 1: fp16 accuracy at --context and --long-context, fp16 PPL."""
    t = time.time()
    ok, texts, _ = run_trials(r.base, trials, "fp16", r.max_new)
    t_trials = time.time() - t
    fp16 = {"accuracy": 100.0 * sum(ok) / len(ok), "by_depth": by_depth(ok, depths, args.trials_per_depth),
            "ci95": wilson(sum(ok), len(ok)), "ok": ok, "answers": texts[:8], "trials": len(ok),
            "trials_s": round(t_trials, 2)}
    long_per_depth = args.long_trials_per_depth or max(1, args.trials_per_depth // 2)
    long = build_trials(r.tok, args.task, "eval", args.long_context, depths, long_per_depth,
                        args.seed + 1, params) if args.long_context else []
    if long:
        ok_l, _, _ = run_trials(r.base, long, "fp16-long", r.max_new)
        fp16["long_context"] = {"context": args.long_context, "accuracy": 100.0 * sum(ok_l) / len(ok_l),
                                "trials": len(ok_l), "by_depth": by_depth(ok_l, depths, long_per_depth)}
    r.payload["fp16"] = fp16
    print(f"fp16: {fp16['accuracy']:.1f}% at {args.context}" +
          (f", {fp16['long_context']['accuracy']:.1f}% at {args.long_context}" if long else ""), flush=True)
    if windows:
        fp16.update(r.ppl(windows, "fp16-ppl", None))
    r.save()
    return fp16


def run(args) -> str:
    from sgl_kvxfer.spectrum.niah import load_filler_texts

    if args.quick:  # CPU smoke sizes
        args.max_total_tokens = args.max_total_tokens or 60000
        args.depths, args.trials_per_depth = min(args.depths, 3), 1
        args.val_trials, args.lambdas = min(args.val_trials, 4), args.lambdas[:2]
        args.ppl_windows, args.profile_samples = min(args.ppl_windows, 1), min(args.profile_samples, 2)
    if not args.cold_tier_tokens:  # host copies for the largest batch of prompts
        args.cold_tier_tokens = max(args.depths * args.trials_per_depth, args.val_trials) * \
            (max(args.context, args.ppl_context + args.ppl_chunk) + 2 * args.max_new_tokens + 64)
    r = Run(args)
    depths = [round(i / (args.depths - 1), 4) for i in range(args.depths)] if args.depths > 1 else [0.5]
    params = dict(p.split("=", 1) for p in args.task_param)
    params = {k: int(v) if v.lstrip("-").isdigit() else v for k, v in params.items()}
    trials = build_trials(r.tok, args.task, "eval", args.context, depths, args.trials_per_depth, args.seed, params)
    val = build_trials(r.tok, args.task, "calib", args.context, [None], args.val_trials, args.seed, params)
    prev = load_resume(args) if args.resume else None
    if prev is None:
        r.payload.update(metadata(args, r.base, {"depths": depths, "methods": args.methods}))
    else:  # continue the earlier call's JSON: same trials, its fp16 ceilings, profile, lambda, threshold
        r.payload.update(prev)
        # "command" becomes this call's (the last writer); the calls before it stay in earlier_calls
        r.payload.setdefault("earlier_calls", []).append({"command": r.payload.pop("command", None),
                                                    "commit": r.payload.get("commit")})
        r.payload.update(commit=git_commit(), started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        r.payload["params"]["methods"] = list(dict.fromkeys(prev["params"]["methods"] + args.methods))
        r.rows = [x for x in prev["rows"] if "accuracy" in x]
    r.payload["prompt_tokens"] = sum(len(t["ids"]) for t in trials) / len(trials)
    r.payload["needle_spans_found"] = sum(t["span"] is not None for t in trials)
    windows = []
    if args.ppl_windows:
        from ppl_sweep import eval_windows

        texts = load_filler_texts(args.prose if os.path.exists(args.prose) else None)
        windows = eval_windows(r.tok, texts, args.ppl_context, args.ppl_chunk, args.ppl_windows, 2)
    if prev is None:
        fp16 = fp16_stage(r, trials, depths, windows, args, params)
        # 2. the profile, 3. validation
        profile = layer_profile(r, val, args) if "per-layer" in args.methods or "cold-tier" in args.methods else None
        r.profile = profile
        lam, threshold = validate(r, val, args)
    else:
        fp16, lam, threshold = prev["fp16"], prev["chosen_lambda"], prev["chosen_threshold"]
        lp = prev.get("layer_profile")
        profile = os.path.join(os.path.dirname(os.path.abspath(args.resume)), lp["path"]) if lp else None
        r.profile = profile
        print(f"resuming {args.resume}: {len(r.rows)} rows, lambda {lam:g}, threshold {threshold:g}", flush=True)
    # 4. the table, method by method in --methods order (a run cut short has whole rows of the heatmap)
    done = {}  # (budget, a method's settings) -> its row
    earlier = {(x["method"], x["budget"]) for x in r.rows}
    for x in r.rows:
        if "same_as" not in x:
            flags, m_lam, cold = method_settings(x["method"], lam, profile)
            done[(x["budget"], tuple(sorted(flags.items())), m_lam, cold, x["backend"])] = x
    for i, method in enumerate(args.methods):
        for b in args.budgets:
            if (method, b) in earlier:
                continue
            flags, m_lam, cold = method_settings(method, lam, profile)
            backend = method_backend(method, args.backend)
            key = (b, tuple(sorted(flags.items())), m_lam, cold, backend)
            same = done.get(key)
            if same is not None:
                r.rows.append({**same, "method": method, "same_as": same["method"], "wall_s": 0.0})
                print(f"b={b:.2f} {method:15s} = {same['method']} (same settings)", flush=True)
                r.save()
                continue
            if r.out_of_time():
                r.rows.append({"method": method, "budget": b, "skipped": "time budget"})
                continue
            t = time.time()
            res = r.point(trials, method, b, lam, profile, threshold, f"{method}-{b}")
            t_trials = time.time() - t
            row = {"method": method, "budget": b, "backend": backend, "lambda": m_lam,
                   "accuracy": 100.0 * sum(res["ok"]) / len(res["ok"]), "trials": len(res["ok"]),
                   "by_depth": by_depth(res["ok"], depths, args.trials_per_depth),
                   "ci95": wilson(sum(res["ok"]), len(res["ok"])), **needle_summary(res["needle_tier"], res["ok"]),
                   **{k: v for k, v in res.items() if k not in ("texts",)}, "answers": res["texts"][:4],
                   "engine_start_s": round(r.started_s, 2), "trials_s": round(t_trials - r.started_s, 2)}
            if windows and method != "cold-tier":  # the cold tier acts in decode; PPL scores prefill logits
                t_ppl = time.time()
                row.update(r.ppl(windows, f"{method}-{b}-ppl", (method, b, lam, profile)))
                row["delta_ppl_pct"] = 100.0 * (row["ppl"] - fp16["ppl"]) / fp16["ppl"]
                row["ppl_s"] = round(time.time() - t_ppl, 2)
            row["wall_s"] = time.time() - t
            done[key] = row
            r.rows.append(row)
            print(f"b={b:.2f} {method:15s} acc {row['accuracy']:5.1f}%  bytes {row['byte_ratio']:.3f}  "
                  f"ppl {row.get('ppl', float('nan')):.3f}  fallback {row['fallback_tokens']}  "
                  f"needle tiers {row['needle_tier_counts']}  "
                  f"{'cold ' + str(row['cold']) if row['cold'] else ''} ({row['wall_s']:.0f}s)", flush=True)
            r.save()
        if i % 4 == 3 and any("accuracy" in x for x in r.rows):  # the heatmaps so far, now and then
            r.payload["summary"] = summarize(r.payload, row_budgets(r.rows))
            plot(r.save())
    r.payload["summary"] = summarize(r.payload, row_budgets(r.rows))
    path = r.save(done=True)
    r.close()
    print("wrote", path)
    return path


def row_budgets(rows) -> list[float]:
    """The budgets of the measured rows, in the order they first ran (every call of a resumed run)."""
    return list(dict.fromkeys(x["budget"] for x in rows if "accuracy" in x))


def summarize(payload: dict, budgets) -> dict:
    """Numbers the targets are read against, computed from the rows (None where a row is missing)."""
    rows = {(x["method"], x["budget"]): x for x in payload["rows"] if "accuracy" in x}
    fp16 = payload["fp16"]["accuracy"]
    acc = lambda m, b: rows[(m, b)]["accuracy"] if (m, b) in rows else None  # noqa: E731
    out = {"fp16_accuracy": fp16}
    for b in budgets:
        names = [m for m in ("greedy", "spectrumkv", "spectrumkv-max", "spectrumkv-torch", "balanced", "adaptive-2tier")
                 if acc(m, b) is not None]
        best_m = max(names, key=lambda m: acc(m, b)) if names else None
        best = acc(best_m, b) if best_m else None
        rand = acc("random-tier", b)
        # per-layer runs on torch: its uniform control is spectrumkv on the same backend
        control = "spectrumkv-torch" if acc("spectrumkv-torch", b) is not None else "spectrumkv"
        s = {"best_spectrumkv": best, "fp16_minus_best": None if best is None else fp16 - best,
             "best_minus_random": None if best is None or rand is None else best - rand,
             "per_layer_minus_spectrumkv": None if acc("per-layer", b) is None or acc(control, b) is None
             else acc("per-layer", b) - acc(control, b), "per_layer_control": control, "best_method": best_m}
        if best_m and rand is not None:  # paired (same items): trials only one of the two answers
            pairs = list(zip(rows[(best_m, b)]["ok"], rows[("random-tier", b)]["ok"]))
            s["best_vs_random_discordant"] = [sum(a and not c for a, c in pairs), sum(c and not a for a, c in pairs)]
        if (m := rows.get(("per-layer", b))) and "delta_ppl_pct" in m:
            s["per_layer_delta_ppl_pct"] = m["delta_ppl_pct"]
        cold, base = acc("cold-tier", b), acc("spectrumkv", b)
        if cold is not None and base is not None and fp16 > base:
            s["cold_tier_recovered_fraction_of_gap"] = (cold - base) / (fp16 - base)
        out[str(b)] = s
    return out


# ---------------------------------------------------------------- plot


def plot(path: str) -> str:
    plt, data = load_for_plot(path)
    depths = data["params"]["depths"]
    budgets = sorted({r["budget"] for r in data["rows"] if "accuracy" in r}, reverse=True)
    methods = [m for m in data["params"]["methods"] if any(r["method"] == m and "accuracy" in r for r in data["rows"])]
    cols = 4
    nrow = -(-(len(methods) + 1) // cols)
    fig, axes = plt.subplots(nrow, cols, figsize=(3.3 * cols, 2.9 * nrow), squeeze=False)
    fp16 = data["fp16"]["by_depth"]
    rows = {(r["method"], r["budget"]): r for r in data["rows"] if "accuracy" in r}
    for ax, method in zip(axes.flat, methods):
        img = [[(rows[(method, b)]["by_depth"][i] if (method, b) in rows else float("nan")) / 100 for b in budgets]
               + [fp16[i] / 100] for i in range(len(depths))]
        ax.imshow(img, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
        ax.set_xticks(range(len(budgets) + 1), [f"{b:g}" for b in budgets] + ["fp16"], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths], fontsize=6)
        means = " / ".join(f"{rows[(method, b)]['accuracy']:.0f}" if (method, b) in rows else "-" for b in budgets)
        ax.set_title(f"{method}: {means}%", fontsize=8)
    ax = axes.flat[len(methods)]
    for method in methods:
        pts = [(b, rows[(method, b)]["accuracy"]) for b in sorted(budgets) if (method, b) in rows]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=method)
    ax.axhline(data["fp16"]["accuracy"], color="k", lw=0.8, ls="--", label="fp16")
    ax.set_xlabel("budget b (bytes)", fontsize=8)
    ax.set_ylabel("accuracy (%)", fontsize=8)
    ax.legend(fontsize=5)
    for extra in list(axes.flat)[len(methods) + 1:]:
        extra.axis("off")
    p = data["params"]
    fig.suptitle(f"{p['task']} retrieval, {p['context']} tokens, {p['trials_per_depth']}/depth; rows: needle depth, "
                 f"columns: budget; lambda {data.get('chosen_lambda')}, threshold {data.get('chosen_threshold')}; "
                 f"{data['device']} @ {data['commit'][:10]}", fontsize=8)
    return save_plot(fig, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--task", default="kv", choices=("kv", "needle"))
    ap.add_argument("--task-param", action="append", default=[], metavar="NAME=VALUE",
                    help="task generator parameter, e.g. hops=2 or distractors=8 (needle)")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--long-context", type=int, default=8000,
                    help="fp16 accuracy also at this length (0: skip); with the chat template and the answer it "
                         "must fit the model's context length")
    ap.add_argument("--depths", type=int, default=11)
    ap.add_argument("--trials-per-depth", type=int, default=4)
    ap.add_argument("--long-trials-per-depth", type=int, default=0,
                    help="fp16 trials per depth at --long-context (0: half of --trials-per-depth, at least 1)")
    ap.add_argument("--backend", default="torch", choices=("torch", "triton"),
                    help="attention backend of every engine but the torch-only methods (kivi, per-layer, "
                         "spectrumkv-torch)")
    ap.add_argument("--val-trials", type=int, default=32)
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.3, 0.2, 0.5])
    ap.add_argument("--val-budgets", type=float, nargs="+", default=[0.3, 0.2])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--lambdas", type=float, nargs="+", default=[0.0, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2])
    ap.add_argument("--cold-thresholds", type=float, nargs="+", default=[0.02])
    ap.add_argument("--promote-interval", type=int, default=16)
    ap.add_argument("--promote-radius", type=int, default=4)
    ap.add_argument("--promote-layers", type=int, default=2)
    ap.add_argument("--promote-drop-run", type=int, default=32,
                    help="dropped tokens contiguous with a promotion that come back too, each side (0: radius only; "
                         "the engine's default)")
    ap.add_argument("--promote-max-tokens", type=int, default=256,
                    help="tokens one scoring pass promotes at most, the strongest stretches first (0: no cap; "
                         "the engine's default)")
    ap.add_argument("--cold-tier-tokens", type=int, default=0, help="host copies (0: the tiered pool's size)")
    ap.add_argument("--max-new-tokens", type=int, default=10)
    ap.add_argument("--profile-samples", type=int, default=16)
    ap.add_argument("--profile-batch", type=int, default=4)
    ap.add_argument("--ppl-windows", type=int, default=4)
    ap.add_argument("--ppl-context", type=int, default=2048)
    ap.add_argument("--ppl-chunk", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-budget-s", type=float, default=0.0, help="stop starting table points after this long")
    ap.add_argument("--resume", default=None, metavar="JSON",
                    help="continue this earlier results JSON (same trials): skip its fp16, profile and validation "
                         "stages and its measured rows, run the rest of --methods x --budgets into it")
    args = ap.parse_args()
    if args.plot_only is None:
        if args.model is None:
            ap.error("--model: the fine-tuned retrieval model dir (scripts/gpu/spectrum_retrieval.sh trains one)")
        if args.long_trials_per_depth < 0:
            ap.error("--long-trials-per-depth must be >= 0")
        if not 0 <= args.promote_drop_run <= 4096:
            ap.error("--promote-drop-run must be in [0, 4096]")
        if not 0 <= args.promote_max_tokens <= 1 << 20:
            ap.error("--promote-max-tokens must be in [0, 1048576]")
        for name in ("context", "depths", "trials_per_depth", "val_trials", "max_new_tokens", "profile_samples",
                     "profile_batch", "promote_interval", "promote_layers"):
            if getattr(args, name) < 1:
                ap.error(f"--{name.replace('_', '-')} must be >= 1")
        if any(not 0 < b <= 1 for b in args.budgets + args.val_budgets) or \
                any(not 0 < t <= 1 for t in args.cold_thresholds) or any(lam < 0 for lam in args.lambdas):
            ap.error("budgets and thresholds must be in (0, 1], lambdas >= 0")
    run_then_plot(args, run, plot)


if __name__ == "__main__":
    main()
