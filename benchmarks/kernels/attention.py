"""Decode attention, one table: SDPA, our two pools' decode kernels per tier mix, FlashInfer.

    python benchmarks/kernels/attention.py                                   # GPU, the default grid
    python benchmarks/kernels/attention.py --sweep-configs --configs '[{"tile8": 128}, ...]'
    python benchmarks/kernels/attention.py --plot-only benchmarks/results/attention_<dev>.json
    python benchmarks/kernels/attention.py --device cpu --points smollm2:1:64 --iters 1   # CPU smoke run

One layer, one decode step, every request of the batch at the same context. Points
(--points MODEL:BATCH:CONTEXT): Llama-3-8B heads (32/8/128) at batch 1 / 8 / 32 and 16k-128k,
SmolLM2 heads (9/3/64) at batch 8, 32k. Variants, side by side in one run:
  sdpa             torch SDPA, enable_gqa=True, dense [B, Hkv, ctx, D]: each backend forced in turn
                   (cuDNN, flash, efficient) and the fastest kept (`sdpa.backends` has all): the
                   baseline every ratio is taken against
  fp16_pool        paged_fp16_pool_decode, the paged fp16 pool's decode (page 64)
  tiered_<mix>     tiered_pool_decode over the engine's own TieredKVPool layout (engine_layout.py:
                   fp16 slot rows at PAGE 1, int8 / int4 page-head blocks of the engine's page,
                   one fp16 scale + zero per token-head, filled tables): fp16, int8, int4 (every
                   token in that tier) and mix_b0.5 (the 64-token decode window fp16, the rest at
                   SpectrumKV's planned fractions for b = 0.5). Tiers holding no token of the
                   layout are not launched (the engine launches every store that has pages)
  flashinfer_fp16  FlashInfer's paged decode (page 64, HND, CUDA cores), where `import flashinfer`
  flashinfer_fp8   works; _fp8: e4m3 K/V, q and o in the model dtype

Time: each variant's inputs in rotated copies (common/bandwidth.py: together >= 3x L2, so every call
reads from DRAM), all copies' calls captured in one CUDA graph and replayed --iters times (>= 5):
median per call, with the min and max over the replays. Bytes = what the kernel must move: K/V
payload with scales and zeros, q read, o written; GB/s = bytes / median; speed = SDPA ms / ms;
% of SDPA bandwidth = GB/s over SDPA's at the same point.

--sweep-configs: before the measurement, the served config of the tiered decode (at the int page
it was tuned at, SERVED_INT_PAGE, as e2e_decode.py serves it) and every
--configs entry (TieredDecodeConfig fields; "int_page" sets the layout's int page size) are timed
at --sweep-points on the fp16 / int8 / int4 / mix layouts (each layout built once per point and
int page, shared by the configs and the table). Among the configs whose every output matches the
served config's on the same cache (within 5% of its largest magnitude; rows that do not are
marked "wrong"), the lowest geometric-mean time over a point's variants is that point's best
(JSON sweep.best_per_point) and over all of a model's swept points the model's best (sweep.best,
with the SERVED_CONFIGS line to paste into kernels/tiered_pool_decode.py). The table then times
every tiered variant of a swept point with its point's best, of another point with its model's
best, else the served config (each row's "config" and "config_source": point / model / served),
in a fresh measurement (the sweep's times only choose). Configs run one after another; none starts
after --sweep-budget-s. A multi-tier mix also records each tier's launch alone ("parts").
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common.bandwidth import (SDPA_BACKENDS, copy_bandwidth_Bps, rotation_copies, sdpa_decode,  # noqa: E402
                              time_rotating)
from common.report import device_name, git_commit, triton_interpreter_for, write_json  # noqa: E402
from engine_layout import build_engine_layout, build_paged_fp16, engine_int_page, engine_tier_counts  # noqa: E402

MODELS = {"llama3-8b": (32, 8, 128), "smollm2": (9, 3, 64)}
TIERED = ("tiered_fp16", "tiered_int8", "tiered_int4", "tiered_mix_b0.5")
VARIANTS = ("sdpa", "fp16_pool", *TIERED, "tiered_fp16_head_major", "flashinfer_fp16", "flashinfer_fp8")
DEFAULT_POINTS = tuple(f"llama3-8b:{b}:{c}" for b in (8, 1, 32) for c in (32768, 16384, 65536, 131072)) + \
    ("smollm2:8:32768",)
DEFAULT_SWEEP_POINTS = ("llama3-8b:8:32768", "llama3-8b:1:32768", "smollm2:8:32768")
SWEEP_VARIANTS = TIERED
CHECK_TOKENS = 16384  # points with B * ctx <= this also check outputs against the torch reference


def parse_point(spec: str):
    model, B, ctx = spec.split(":")
    return model, int(B), int(ctx)


# ---------------------------------------------------------------------------------------- variants
def flashinfer_timing(B, ctx, Hq, Hkv, D, q, dev, iters, max_bytes, fp8=False) -> dict:
    """FlashInfer's paged decode over rotated K/V copies sharing one plan (flashinfer_baseline.py's
    layout and wrapper); {"error": ...} where it does not import or run."""
    try:
        import flashinfer  # noqa: F401
        from flashinfer_baseline import PAGE, build_paged_kv, decode_wrapper
    except Exception as exc:  # noqa: BLE001
        return {"error": f"flashinfer not importable: {type(exc).__name__}: {exc}"[:300]}
    kv_dtype = torch.float8_e4m3fn if fp8 else q.dtype
    try:
        kv_bytes = 2 * B * Hkv * ctx * D * kv_dtype.itemsize
        copies = rotation_copies(kv_bytes, dev, max_bytes)
        (k, v), _, _, _ = build_paged_kv(copies * B, ctx, Hkv, D, PAGE, kv_dtype, dev)  # copies * P + 1 pages
        n = -(-ctx // PAGE)
        P = B * n  # copy i: pages [i P, (i + 1) P] of the pool, its page 0 unused (the pool's padding page)
        kvs = [(k[i * P:(i + 1) * P + 1], v[i * P:(i + 1) * P + 1]) for i in range(copies)]
        indices = (torch.randperm(P, device=dev) + 1).to(torch.int32)
        indptr = torch.arange(0, P + 1, n, dtype=torch.int32, device=dev)
        last = torch.full((B,), ctx - (n - 1) * PAGE, dtype=torch.int32, device=dev)
        w = decode_wrapper(B, indices.numel(), False, dev)
        w.plan(indptr, indices, last, Hq, Hkv, D, PAGE, q_data_type=q.dtype, kv_data_type=kv_dtype,
               o_data_type=q.dtype)
        o = torch.empty_like(q)
        res = time_rotating([lambda kv=kv: w.run(q, kv, out=o) for kv in kvs], dev, iters)
        res.update(bytes=kv_bytes + 2 * q.numel() * q.element_size(), kv_dtype=str(kv_dtype))
        return res
    except Exception as exc:  # noqa: BLE001 - a JIT build or a kernel that does not run
        return {"error": f"{type(exc).__name__}: {exc}"[:1000]}


def sdpa_timing(B, ctx, Hq, Hkv, D, dtype, dev, iters, max_bytes) -> dict:
    """Every SDPA backend forced in turn (CUDA); the fastest is the row's SDPA."""
    if dev.type != "cuda":
        return sdpa_decode(B, Hq, Hkv, ctx, D, dtype, dev, iters, max_bytes)
    runs = {}
    for be in SDPA_BACKENDS:
        try:
            runs[be] = sdpa_decode(B, Hq, Hkv, ctx, D, dtype, dev, iters, max_bytes, backend=be)
        except Exception as exc:  # noqa: BLE001 - a backend that does not take this shape
            runs[be] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        torch.cuda.empty_cache()
    ok = {k: r for k, r in runs.items() if "ms" in r}
    if not ok:
        raise RuntimeError(f"no SDPA backend ran: {runs}")
    best = dict(ok[min(ok, key=lambda k: ok[k]["ms"])])
    best["backends"] = {k: r.get("ms", r.get("error")) for k, r in runs.items()}
    return best


def fp16_pool_timing(B, ctx, Hq, Hkv, D, q, dev, iters, max_bytes) -> dict:
    from sgl_kvxfer.kernels.paged_fp16_pool_decode import paged_fp16_pool_decode, plan_fp16_splits

    kv_bytes = 2 * B * Hkv * ctx * D * q.element_size()
    lay = build_paged_fp16(B, ctx, Hkv, D, q.dtype, dev, rotation_copies(kv_bytes, dev, max_bytes))
    plan = plan_fp16_splits(lay.tables[0].shape[1], B, Hkv, dev)  # once per batch, as the backend
    o = torch.empty_like(q)
    res = time_rotating([lambda t=t: paged_fp16_pool_decode(q, lay.k_pages, lay.v_pages, t, lay.seq_lens, out=o,
                                                            split_plan=plan, check=False)
                         for t in lay.tables], dev, iters)
    res["bytes"] = kv_bytes + 2 * q.numel() * q.element_size()
    res["splits"] = plan[1]
    return res


def tiered_layout(B, ctx, Hkv, D, q, mix, dev, max_bytes, int_page=None):
    """The engine layout of `mix` with as many copies as rotation_copies asks for its bytes."""
    counts = engine_tier_counts(ctx, mix, Hkv, D)
    one = build_engine_layout(B, counts, Hkv, D, q.dtype, dev, copies=1, page_size=int_page)
    copies = rotation_copies(one.kv_bytes(D, q.element_size()), dev, max_bytes)
    return one if copies == 1 else build_engine_layout(B, counts, Hkv, D, q.dtype, dev, copies=copies,
                                                       page_size=int_page)


def split_config(d: dict | None):
    """A sweep entry -> (TieredDecodeConfig or None for the served one, int page or None)."""
    from sgl_kvxfer.kernels.tiered_pool_decode import TieredDecodeConfig

    if d is None:
        return None, None
    d = dict(d)
    page = d.pop("int_page", None)
    return TieredDecodeConfig(**d), page


def tiered_timing(B, ctx, Hq, Hkv, D, q, mix, dev, iters, max_bytes, entry=None, layout=None,
                  check_served=False, parts=False) -> dict:
    """One tiered variant at one config. layout: an EngineLayout, or a callable (mix, int page) ->
    layout (the sweep's cache), or None (built here). parts: a multi-tier mix also times each
    tier's launch alone on the same layout (res["parts"])."""
    from sgl_kvxfer.kernels.tiered_pool_decode import (describe_served, fallbacks, plan_tiered_pool_decode,
                                                       served_config, tiered_pool_decode,
                                                       tiered_pool_decode_reference)

    cfg, page = split_config(entry)
    if cfg is None:  # the served config at the int page it was tuned at: what e2e_decode.py serves
        cfg, page = served_config(D, Hq // Hkv), describe_served(D, Hq // Hkv)["tuned_int_page"]
    if layout is None:
        layout = tiered_layout(B, ctx, Hkv, D, q, mix, dev, max_bytes, page)
    elif callable(layout):  # a cache: (mix, int page) -> layout
        layout = layout(mix, page)
    plan = plan_tiered_pool_decode(B, Hkv, layout.max_tokens, dev, cfg)  # the backend plans from the width
    o = torch.empty_like(q)
    tiers = layout.tiers
    res = time_rotating([lambda t=t: tiered_pool_decode(q, layout.layer, t, out=o, plan=plan, config=cfg, tiers=tiers,
                                                        check=False) for t in layout.tables], dev, iters)
    res.update(bytes=layout.kv_bytes(D, q.element_size()) + 2 * q.numel() * q.element_size(),
               counts=layout.counts, tiers=tiers, splits=plan.num_splits, int_page=layout.layer.page_size_of(1),
               config=entry if entry is not None else "served", config_fields=str(cfg))
    def asked(t):
        split_tokens = int(layout.tables[0].tables[t].shape[1]) * layout.layer.page_size_of(t) // plan.num_splits
        tile, warps, stages = cfg.launch(t, split_tokens)
        return {"tile": tile, "warps": warps, "stages": stages}

    if parts and len(tiers) > 1:  # each tier's launch alone over the same layout: where a mix's time goes
        res["parts"] = {}
        for t in tiers:
            p = time_rotating([lambda tb=tb: tiered_pool_decode(q, layout.layer, tb, out=o, plan=plan, config=cfg,
                                                                 tiers=(t,), check=False) for tb in layout.tables],
                              dev, iters)
            res["parts"][f"tier{t}"] = {k: p[k] for k in ("ms", "ms_min", "ms_max")}
    ran_other = [f for f in fallbacks() if f["head_dim"] == D and (
        ("tier" in f and f["tier"] in tiers and f["asked"] == asked(f["tier"]))
        or ("one_launch" in f and cfg.one_launch and tuple(f["tiers"]) == tuple(tiers)))]
    if ran_other:  # a config past the GPU's shared memory ran with fewer stages / a smaller tile
        res["fallbacks"] = ran_other
    if B * ctx <= CHECK_TOKENS:
        ref = tiered_pool_decode_reference(q, layout.layer, layout.tables[0])
        got = tiered_pool_decode(q, layout.layer, layout.tables[0], plan=plan, config=cfg, tiers=tiers)
        res["max_abs_diff_vs_reference"] = float((got.float() - ref.float()).abs().max())
    if check_served:  # the sweep: this config's output against the served config's, same cache
        served = served_config(D, Hq // Hkv)
        t0 = layout.tables[0]
        got = tiered_pool_decode(q, layout.layer, t0, plan=plan, config=cfg, tiers=tiers).float()
        want = tiered_pool_decode(q, layout.layer, t0, config=served, tiers=tiers).float()
        res["max_abs_diff_vs_served"] = float((got - want).abs().max())
        res["max_abs_served"] = float(want.abs().max())
    return res


def head_major_fp16(layout):
    """The layout with its fp16 rows stored head-major ([Hkv, P, PAGE, D] underneath, the same
    [P, Hkv, PAGE, D] view and values): a head's rows of a request are then contiguous in memory,
    as SDPA's dense K / V are, where the engine's token-major store interleaves the heads (one
    D-wide row per head every Hkv * D elements). The kernel addresses rows through the store's
    strides, so it reads either layout unchanged."""
    import dataclasses

    layer = layout.layer
    fp16 = layer.pages[0]
    def hm(x):
        return x.permute(1, 0, 2, 3).contiguous().permute(1, 0, 2, 3)
    pages = (dataclasses.replace(fp16, k=hm(fp16.k), v=hm(fp16.v)), *layer.pages[1:])
    return dataclasses.replace(layout, layer=dataclasses.replace(layer, pages=pages))


def agrees_with_served(row: dict) -> bool:
    """A sweep row whose output matches the served config's (finite, within 5% of the output's
    largest magnitude): rounding differs between configs (qk_int8 rounds q), wrong results do not."""
    d, m = row.get("max_abs_diff_vs_served"), row.get("max_abs_served")
    return d is None or (math.isfinite(d) and d <= 0.05 * m + 1e-4)


# ---------------------------------------------------------------------------------------- run
def derive(res: dict, copy_bw: float) -> None:
    """GB/s, % of copy bandwidth, speed and % of SDPA's read bandwidth at this point, in place."""
    sdpa = res.get("sdpa", {})
    sdpa_bw = sdpa["bytes"] / (sdpa["ms"] * 1e-3) if "ms" in sdpa else None
    for r in res.values():
        if isinstance(r, dict) and "ms" in r:
            bw = r["bytes"] / (r["ms"] * 1e-3)
            r["GBps"], r["pct_copy_bw"] = bw / 1e9, 100 * bw / copy_bw
            if sdpa_bw:
                r["speed_vs_sdpa"], r["pct_sdpa_bw"] = sdpa["ms"] / r["ms"], 100 * bw / sdpa_bw


def free_bytes(dev: torch.device) -> int:
    if dev.type == "cuda":
        return torch.cuda.mem_get_info(dev)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def measure_point(args, env, model, B, ctx, entries, cache: LayoutCache | None = None) -> dict:
    """Every variant at one point; the tiered ones with entries[(model, B, ctx)] (the sweep's best at
    this point) where there is one, else entries[model] (the best over the model's swept points),
    else the served config; "config_source" says which."""
    Hq, Hkv, D = MODELS[model]
    if (model, B, ctx) in entries:
        entry, source = entries[(model, B, ctx)], "point"
    else:
        entry, source = entries.get(model), "model"
    if entry is None:
        source = "served" if source == "model" else "point"
    dev, iters = env["dev"], args.iters
    dtype = getattr(torch, args.dtype)
    q = torch.randn(B, Hq, D, dtype=dtype, device=dev)
    res = {"model": model, "batch": B, "context": ctx, "Hq": Hq, "Hkv": Hkv, "D": D}
    for v in args.variants:
        t = time.time()
        try:
            if v == "sdpa":
                r = sdpa_timing(B, ctx, Hq, Hkv, D, dtype, dev, iters, env["max_bytes"])
            elif v == "fp16_pool":
                r = fp16_pool_timing(B, ctx, Hq, Hkv, D, q, dev, iters, env["max_bytes"])
            elif v.startswith("flashinfer"):
                r = (flashinfer_timing(B, ctx, Hq, Hkv, D, q, dev, iters, env["max_bytes"], v.endswith("fp8"))
                     if dev.type == "cuda" else {"skipped": "CUDA only"})
            elif v == "tiered_fp16_head_major":
                lay = head_major_fp16(tiered_layout(B, ctx, Hkv, D, q, "fp16", dev, env["max_bytes"]))
                r = tiered_timing(B, ctx, Hq, Hkv, D, q, "fp16", dev, iters, env["max_bytes"], entry, layout=lay)
                r["config_source"] = source
            else:
                r = tiered_timing(B, ctx, Hq, Hkv, D, q, v[len("tiered_"):], dev, iters, env["max_bytes"],
                                  entry, layout=cache.getter(B, ctx, Hkv, D, q) if cache else None, parts=True)
                r["config_source"] = source
        except Exception as exc:  # noqa: BLE001 - out of memory, a kernel that rejects the shape: record it
            r = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            print(f"{model} B={B} ctx={ctx} {v}: {r['error'][:200]}", flush=True)
        r["wall_s"] = time.time() - t
        res[v] = r
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if cache is not None:
        cache.drop(B, ctx, Hkv, D)
    derive(res, env["copy_bw"])
    return res


class LayoutCache:
    """Engine layouts kept across the sweep's configs and the table's run of a point: one build
    per (point, mix, int page); `drop` frees a point's layouts once its table row is measured."""

    def __init__(self, env):
        self.env, self.layouts = env, {}

    def getter(self, B, ctx, Hkv, D, q):
        def get(mix, page):
            key = (B, ctx, Hkv, D, mix, page)
            if key not in self.layouts:
                self.layouts[key] = tiered_layout(B, ctx, Hkv, D, q, mix, self.env["dev"], self.env["max_bytes"], page)
            return self.layouts[key]
        return get

    def drop(self, B, ctx, Hkv, D, keep_page="none"):
        """Free a point's layouts (but those of int page keep_page: None is the engine's page)."""
        for key in [k for k in self.layouts if k[:4] == (B, ctx, Hkv, D) and k[5] != keep_page]:
            del self.layouts[key]
        if self.env["dev"].type == "cuda":
            torch.cuda.empty_cache()


def geomean(xs) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def pick_best(rows: list, entries: list, sel) -> tuple[int, float] | None:
    """(index into entries, geometric-mean ms) of the fastest config over the (point, variant)
    pairs of `rows` that sel(row) keeps and the served config ran; a config counts only where it
    ran every such pair and no output of it was wrong."""
    mine = [r for r in rows if "model" in r and sel(r)]
    keys = {(r["model"], r["batch"], r["context"], r["variant"]) for r in mine if r["config"] == "served" and "ms" in r}
    scores = {}
    for i, entry in enumerate(entries):
        rs = [r for r in mine if r["config"] == (entry if entry is not None else "served")]
        ms = [r["ms"] for r in rs if "ms" in r]
        if keys and len(ms) == len(keys) and not any(r.get("wrong") for r in rs):
            scores[i] = geomean(ms)
    if not scores:
        return None
    i = min(scores, key=scores.get)
    return i, scores[i]


def sweep(args, env, rows: list, cache: LayoutCache) -> tuple[dict, dict]:
    """Every config (the served one first) x sweep point x SWEEP_VARIANTS, appended to `rows`,
    config-major so that --sweep-budget-s cuts whole configs (like triton.autotune, the winner is
    re-timed in the table, not reported from here) -> ({model: best entry over its points},
    {(model, B, ctx): best entry at that point}), best = lowest geometric-mean ms over the
    variants the served config ran. Layouts are built once per point, mix and int page (cache)."""
    dev, dtype, t0 = env["dev"], getattr(torch, args.dtype), time.time()
    entries = [None, *args.configs]
    for i, entry in enumerate(entries):
        if i and time.time() - t0 > args.sweep_budget_s:
            rows.append({"config": entry, "skipped": f"--sweep-budget-s {args.sweep_budget_s} spent"})
            continue
        for spec in args.sweep_points:
            model, B, ctx = parse_point(spec)
            Hq, Hkv, D = MODELS[model]
            q = torch.randn(B, Hq, D, dtype=dtype, device=dev, generator=torch.Generator(dev).manual_seed(0))
            for v in [x for x in SWEEP_VARIANTS if x in args.variants]:
                row = {"model": model, "batch": B, "context": ctx, "variant": v,
                       "config": entry if entry is not None else "served"}
                try:
                    r = tiered_timing(B, ctx, Hq, Hkv, D, q, v[len("tiered_"):], dev, args.iters, env["max_bytes"],
                                      entry, layout=cache.getter(B, ctx, Hkv, D, q), check_served=entry is not None)
                    row.update({k: r[k] for k in ("ms", "ms_min", "ms_max", "bytes", "splits", "int_page")})
                    for k in ("max_abs_diff_vs_served", "max_abs_served"):
                        if k in r:
                            row[k] = r[k]
                    if not agrees_with_served(row):
                        row["wrong"] = True  # never a sweep's best
                    if "fallbacks" in r:
                        row["fallbacks"] = r["fallbacks"]
                    row["GBps"] = r["bytes"] / (r["ms"] * 1e-3) / 1e9
                except Exception as exc:  # noqa: BLE001 - a config the kernel rejects, out of memory
                    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                rows.append(row)
                print("sweep", {k: row[k] for k in row if k != "bytes"}, flush=True)
    best, best_point = {}, {}
    for model in {r["model"] for r in rows if "model" in r}:
        got = pick_best(rows, entries, lambda r, m=model: r["model"] == m)
        if got:
            best[model] = entries[got[0]]
    for spec in args.sweep_points:
        model, B, ctx = parse_point(spec)
        got = pick_best(rows, entries, lambda r, p=(model, B, ctx): (r["model"], r["batch"], r["context"]) == p)
        if got:
            best_point[(model, B, ctx)] = (entries[got[0]], got[1])
    return best, best_point


def served_line(model: str, entry) -> str:
    """The SERVED_CONFIGS line of kernels/tiered_pool_decode.py for a model's best entry."""
    Hq, Hkv, D = MODELS[model]
    if entry is None:
        return f"# {model}: the served config won"
    fields = {k: v for k, v in entry.items() if k != "int_page"}
    args = ", ".join(f"{k}={v!r}" for k, v in fields.items())
    page = f"  # with --kv-tier-page-size {entry['int_page']}" if "int_page" in entry else ""
    return f"    ({D}, {Hq // Hkv}): TieredDecodeConfig({args}),{page}"


def meta(args, env, rows, skipped, sweep_rows, best, partial, best_point=None) -> dict:
    from sgl_kvxfer.kernels.tiered_pool_decode import served_config

    served = {m: str(served_config(D, Hq // Hkv)) for m, (Hq, Hkv, D) in MODELS.items()}
    return {
        "benchmark": "decode attention: SDPA, paged fp16 pool, tiered pool per tier mix, FlashInfer",
        "device": env["device"], "sm_count": env["sms"], "torch": torch.__version__,
        "triton": __import__("triton").__version__, "commit": git_commit(), "partial": partial,
        "params": {k: v for k, v in vars(args).items() if k not in ("plot_only",)},
        "served_configs": served, "int_page": engine_int_page(),
        "timing": "rotated input copies (>= 3x L2) in one CUDA graph, CUDA events, median (min, max) over "
                  "--iters replays, per call",
        "bytes": "K/V payload incl. per-token-head scales and zeros + q read + o written",
        "copy_bandwidth_Bps": env["copy_bw"], "results": rows, "skipped": skipped,
        "sweep": {"rows": sweep_rows, "best": [{"model": m, "config": c if c is not None else "served",
                                                "served_configs_line": served_line(m, c)} for m, c in best.items()],
                  "best_per_point": [{"model": m, "batch": b, "context": c, "config": e if e is not None else "served",
                                      "geomean_ms": g} for (m, b, c), (e, g) in (best_point or {}).items()]}
        if args.sweep_configs else None,
    }


def run(args, on_update=None) -> dict:
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    props = torch.cuda.get_device_properties(dev) if cuda else None
    env = {"dev": dev, "device": props.name if cuda else device_name("cpu"),
           "sms": props.multi_processor_count if cuda else None, "copy_bw": copy_bandwidth_Bps(dev),
           "max_bytes": int(0.25 * free_bytes(dev)) if cuda else (64 << 20)}
    print(f"device {env['device']}  copy {env['copy_bw'] / 1e12:.2f} TB/s", flush=True)
    rows, skipped, sweep_rows, best, best_point = [], [], [], {}, {}
    state = {"partial": True}
    cache = LayoutCache(env)

    def report(partial):
        return meta(args, env, rows, skipped, sweep_rows, best, partial, best_point)

    def update():
        if on_update is not None:
            on_update(report(state["partial"]))

    try:
        if args.sweep_configs:
            b, bp = sweep(args, env, sweep_rows, cache)
            best.update(b)
            best_point.update(bp)
            update()
        entries = {}
        if args.measure_config == "best":
            entries = {**best, **{k: e for k, (e, _) in best_point.items() if e is not None}}
            # a point whose best is the served config measures with it, not with its model's best
            entries.update({k: None for k, (e, _) in best_point.items() if e is None})
        table = {parse_point(p) for p in args.points}
        for m, b, c in {parse_point(p) for p in args.sweep_points}:  # keep what the table reads
            _, Hkv, D = MODELS[m]
            e = entries[(m, b, c)] if (m, b, c) in entries else entries.get(m)
            cache.drop(b, c, Hkv, D, split_config(e)[1] if (m, b, c) in table else "none")
        for spec in args.points:
            model, B, ctx = parse_point(spec)
            Hq, Hkv, D = MODELS[model]
            need = 2 * B * Hkv * ctx * D * torch.finfo(getattr(torch, args.dtype)).bits // 8
            if B * ctx > args.max_tokens or 2.5 * need > 0.8 * free_bytes(dev):
                skipped.append({"model": model, "batch": B, "context": ctx, "fp16_kv_bytes": need,
                                "reason": "B * ctx > --max-tokens" if B * ctx > args.max_tokens else "memory"})
                print(f"skip {model} B={B} ctx={ctx}: {skipped[-1]['reason']}", flush=True)
                continue
            t = time.time()
            res = measure_point(args, env, model, B, ctx, entries, cache)
            rows.append(res)
            print(f"{model} B={B} ctx={ctx} ({time.time() - t:.1f}s): " + "  ".join(
                f"{v}={res[v]['ms'] * 1e3:.1f}us/{res[v].get('speed_vs_sdpa', 0):.2f}x/{res[v]['GBps']:.0f}GB/s"
                for v in args.variants if "ms" in res.get(v, {})), flush=True)
            update()
    except KeyboardInterrupt:  # `timeout -s INT`: keep what was measured
        print("interrupted: writing the points measured so far", flush=True)
        return report(True)
    state["partial"] = False
    return report(False)


# ---------------------------------------------------------------------------------------- report
def summary(data: dict) -> str:
    """Markdown: per point, SDPA's time and backend, then every variant's speed vs SDPA with its
    GB/s and the spread of its replays."""
    names = [v for v in VARIANTS if v != "sdpa" and any("ms" in r.get(v, {}) for r in data["results"])]
    out = ["| model | batch | context | SDPA us (backend, GB/s) | " + " | ".join(names) + " |",
           "|---" * (4 + len(names)) + "|"]
    for r in data["results"]:
        s = r.get("sdpa", {})
        sdpa = (f"{s['ms'] * 1e3:.1f} ({str(s.get('backend', '?')).split('_')[0].lower()}, {s['GBps']:.0f})"
                if "ms" in s else "-")
        cells = []
        for v in names:
            x = r.get(v, {})
            if "speed_vs_sdpa" not in x:
                cells.append("-")
                continue
            spread = 100 * (x["ms_max"] - x["ms_min"]) / x["ms"] if "ms_max" in x else 0
            cells.append(f"{x['speed_vs_sdpa']:.2f}x ({x['GBps']:.0f} GB/s, ±{spread / 2:.0f}%)")
        out.append(f"| {r['model']} | {r['batch']} | {r['context']} | {sdpa} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot(data: dict, path: str) -> bool:
    """Per model and batch: speed vs SDPA and achieved GB/s over context."""
    rows = data["results"]
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["model"], r["batch"]) for r in rows})
    variants = [v for v in VARIANTS if any("ms" in r.get(v, {}) for r in rows)]
    fig, axes = plt.subplots(2, len(groups), figsize=(4.6 * len(groups), 7.2), squeeze=False)
    for j, (m, b) in enumerate(groups):
        sel = sorted((r for r in rows if r["model"] == m and r["batch"] == b), key=lambda r: r["context"])
        for k, (key, label) in enumerate((("speed_vs_sdpa", "speed vs SDPA (x)"), ("GBps", "achieved GB/s"))):
            ax = axes[k][j]
            for v in variants:
                pts = [(r["context"], r[v][key]) for r in sel if key in r.get(v, {})]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=v, ls="-" if v.startswith("tiered") else "--")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{m}, batch {b}", fontsize=9)
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel(label)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=6)
    fig.suptitle(f"{data['device']} @ {str(data['commit'])[:10]}, copy {data['copy_bandwidth_Bps'] / 1e12:.2f} TB/s, "
                 f"int page {data.get('int_page')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cpu: Triton's interpreter, perf_counter timing (a smoke run, not a measurement)")
    ap.add_argument("--points", nargs="+", default=list(DEFAULT_POINTS), help="MODEL:BATCH:CONTEXT, in the order run")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    ap.add_argument("--iters", type=int, default=10, help="timed graph replays per variant (>= 1; 5+ on a GPU)")
    ap.add_argument("--max-tokens", type=int, default=1 << 22, help="skip points with B * ctx above this")
    ap.add_argument("--sweep-configs", action="store_true", help="time --configs (and the served config) first")
    ap.add_argument("--configs", type=json.loads, default=[],
                    help="JSON list of objects: TieredDecodeConfig fields, plus int_page (the layout's int page)")
    ap.add_argument("--sweep-points", nargs="+", default=list(DEFAULT_SWEEP_POINTS), help="MODEL:BATCH:CONTEXT")
    ap.add_argument("--sweep-budget-s", type=float, default=90.0,
                    help="start no further config once the sweep has run this long")
    ap.add_argument("--measure-config", choices=["best", "served"], default="best",
                    help="after a sweep: measure the tiered variants with each model's best config or the served one")
    ap.add_argument("--out-dir", default=None, help="where the JSON and PNG go (default benchmarks/results)")
    ap.add_argument("--name", default=None, help="result name (default attention_<device>)")
    ap.add_argument("--plot-only", default=None, help="re-plot an existing JSON")
    args = ap.parse_args(argv)
    if args.plot_only:
        with open(args.plot_only) as f:
            plot(json.load(f), args.plot_only.replace(".json", ".png"))
        return
    if args.iters < 1:
        ap.error("--iters must be >= 1")
    if not isinstance(args.configs, list) or not all(isinstance(c, dict) for c in args.configs):
        ap.error("--configs must be a JSON list of objects")
    for spec in list(args.points) + list(args.sweep_points):
        parts = spec.split(":")
        if len(parts) != 3 or parts[0] not in MODELS or not (parts[1].isdigit() and parts[2].isdigit()) \
                or int(parts[1]) < 1 or int(parts[2]) < 1:
            ap.error(f"{spec!r} is not MODEL:BATCH:CONTEXT (MODEL in {list(MODELS)}, positive integers)")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("no CUDA device: pass --device cpu (tiny shapes)")
    triton_interpreter_for(args.device)  # before any kernel module is imported
    for c in args.configs:
        try:
            split_config(c)
        except (TypeError, ValueError) as exc:
            ap.error(f"--configs: {c}: {exc}")
    signal.signal(signal.SIGINT, signal.default_int_handler)
    dev_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else device_name("cpu").split(" (")[0]
    name = args.name or f"attention_{dev_name.replace(' ', '_').replace('/', '_')}"

    def dump(d):
        return write_json(name, d, args.out_dir)

    data = run(args, on_update=dump)
    path = dump(data)
    print(summary(data))
    if data.get("sweep"):
        for b in data["sweep"]["best"]:
            print(f"best config {b['model']}: {b['config']}\n{b['served_configs_line']}")
        for b in data["sweep"]["best_per_point"]:
            print(f"best config at {b['model']}:{b['batch']}:{b['context']}: {b['config']} "
                  f"(geomean {b['geomean_ms'] * 1e3:.1f} us over the tiered variants)")
    print("wrote", path)
    try:
        if plot(data, path.replace(".json", ".png")):
            print("wrote", path.replace(".json", ".png"))
    except Exception as exc:  # noqa: BLE001
        print("plot failed:", repr(exc))


if __name__ == "__main__":
    main()
