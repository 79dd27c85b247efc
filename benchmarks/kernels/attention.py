"""Decode attention over the engine's tiered KV layout vs torch SDPA, our fp16 paged decode and FlashInfer.

    python benchmarks/kernels/attention.py                                   # GPU, every point
    python benchmarks/kernels/attention.py --sweep-configs --configs '[{"block_n": 128}, ...]'
    python benchmarks/kernels/attention.py --plot-only benchmarks/results/attention_<dev>.json
    python benchmarks/kernels/attention.py --device cpu --models smollm2 --contexts 128 \
        --batches 1 --iters 1                                                # CPU smoke run

One layer, one decode step, every request of the batch at the same context. Variants:
  sdpa_fp16        torch SDPA, default backend (cuDNN on an H100), enable_gqa=True, dense
                   [B, Hkv, ctx, D]: the baseline every ratio is taken against
  paged_fp16       our fp16 paged decode, decode_attention_tiered on a uniform page-64 fp16 layout
  flashinfer_fp16  FlashInfer's paged decode (CUDA cores, page 64, HND), where `import flashinfer`
                   works; flashinfer_fp8 (e4m3 K/V) on request (--variants)
  filled_<mix>     decode_attention_filled over the engine's layout (engine_layout.py: fp16 slot
                   rows at PAGE 1, int8 / int4 pages of 64, one fp16 scale + zero per token-head,
                   filled tables): fp16, int8, int4 (all tokens) and mix_b0.5 (the decode window
                   fp16, the rest at SpectrumKV's planned fractions for b = 0.5)
Until kernels/filled_decode_attention.py exists the filled variants run its torch reference
(filled_kernel.py): on CUDA they are then skipped (a host loop is not worth timing).

Time: each variant's inputs in rotated copies (common/bandwidth.py: together >= 3x L2), all
copies' calls captured in one CUDA graph and replayed, median of --iters replays / copies.
Bytes = what the kernel must move: K/V payload with scales and zeros, q read, o written.
Reported per variant: ms, speed vs SDPA (sdpa ms / ms), bytes, % of the copy bandwidth (torch
copy_, read + write) and % of SDPA's effective read bandwidth at the same point.

--sweep-configs: before the measurement, every --configs entry (FilledDecodeConfig(**d)) and the
kernel's default config are timed at --sweep-points for each filled variant; every time is
recorded, and the measurement then runs each (model, variant) with the config of the lowest
geometric-mean time over that model's sweep points (--measure-config default: the defaults).
Configs run one after another over all points; none starts after --sweep-budget-s.
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
from common.bandwidth import copy_bandwidth_Bps, rotation_copies, sdpa_decode, time_rotating  # noqa: E402
from common.report import device_name, git_commit, triton_interpreter_for, write_json  # noqa: E402
from engine_layout import build_engine_layout, build_uniform_fp16, engine_tier_counts  # noqa: E402

MODELS = {"llama3-8b": (32, 8, 128), "smollm2": (9, 3, 64)}
FILLED = ("filled_fp16", "filled_int8", "filled_int4", "filled_mix_b0.5")
DEFAULT_VARIANTS = ("sdpa_fp16", "paged_fp16", "flashinfer_fp16", *FILLED)
ALL_VARIANTS = (*DEFAULT_VARIANTS, "flashinfer_fp8")
DEFAULT_CONTEXTS = (1024, 4096, 16384, 32768, 65536, 131072)
DEFAULT_SWEEP_POINTS = ("llama3-8b:8:32768", "llama3-8b:1:32768", "smollm2:8:32768")
CHECK_TOKENS = 16384  # points with B * ctx <= this also check outputs against the torch reference


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


def filled_timing(kernel, B, ctx, Hq, Hkv, D, q, mix, dev, iters, max_bytes, config=None, layout=None) -> dict:
    """decode_attention_filled over the engine layout of `mix` (built here unless `layout` is given)."""
    if layout is None:
        layout = engine_layout_for(B, ctx, Hkv, D, q, mix, dev, max_bytes)
    cfg = kernel.make_config(config)
    plan = kernel.make_plan(B, Hkv, layout.max_tokens, dev, cfg, head_dim=D, num_q_heads=Hq, dtype=q.dtype,
                            group_size=D)
    o = torch.empty_like(q)
    res = time_rotating([lambda t=t: kernel(q, layout.layer, t, out=o, plan=plan, config=cfg)
                         for t in layout.tables], dev, iters)
    res.update(bytes=layout.kv_bytes(D, q.element_size()) + 2 * q.numel() * q.element_size(),
               counts=layout.counts, planned=plan is not None, config=config if config is not None else "default")
    if kernel.available and B * ctx <= CHECK_TOKENS:
        from sgl_kvxfer.kernels.decode_attention import decode_attention_tiered_reference

        ref = decode_attention_tiered_reference(q, layout.layer, layout.tables[0])
        got = kernel(q, layout.layer, layout.tables[0], plan=plan, config=cfg)
        res["max_abs_diff_vs_reference"] = float((got.float() - ref.float()).abs().max())
    return res


def engine_layout_for(B, ctx, Hkv, D, q, mix, dev, max_bytes):
    """The engine layout of `mix` with as many copies as rotation_copies asks for its bytes."""
    counts = engine_tier_counts(ctx, mix, Hkv, D)
    one = build_engine_layout(B, counts, Hkv, D, q.dtype, dev, copies=1)
    copies = rotation_copies(one.kv_bytes(D, q.element_size()), dev, max_bytes)
    return one if copies == 1 else build_engine_layout(B, counts, Hkv, D, q.dtype, dev, copies=copies)


def paged_fp16_timing(B, ctx, Hq, Hkv, D, q, dev, iters, max_bytes) -> dict:
    from sgl_kvxfer.kernels.decode_attention import decode_attention_tiered, plan_splits

    kv_bytes = 2 * B * Hkv * ctx * D * q.element_size()
    layer, tables = build_uniform_fp16(B, ctx, Hkv, D, q.dtype, dev, rotation_copies(kv_bytes, dev, max_bytes))
    split = plan_splits(tables[0], Hkv, D, layer.group_size, q.element_size(), dev)  # once per batch
    o = torch.empty_like(q)
    res = time_rotating([lambda t=t: decode_attention_tiered(q, layer, t, out=o, split_plan=split)
                         for t in tables], dev, iters)
    res["bytes"] = kv_bytes + 2 * q.numel() * q.element_size()
    return res


def derive(res: dict, copy_bw: float) -> None:
    """GB/s, % of copy bandwidth, speed and % of read bandwidth vs SDPA at this point, in place."""
    sdpa = res.get("sdpa_fp16", {})
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


def measure_point(args, env, model, B, ctx, configs) -> dict:
    Hq, Hkv, D = MODELS[model]
    dev, kernel, iters = env["dev"], env["kernel"], args.iters or (10 if B * ctx >= (1 << 20) else 20)
    dtype = getattr(torch, args.dtype)
    q = torch.randn(B, Hq, D, dtype=dtype, device=dev)
    res = {"model": model, "batch": B, "context": ctx, "Hq": Hq, "Hkv": Hkv, "D": D}
    for v in args.variants:
        t = time.time()
        try:
            if v == "sdpa_fp16":
                r = sdpa_decode(B, Hq, Hkv, ctx, D, dtype, dev, iters, env["max_bytes"])
            elif v == "paged_fp16":
                r = paged_fp16_timing(B, ctx, Hq, Hkv, D, q, dev, iters, env["max_bytes"])
            elif v.startswith("flashinfer"):
                r = (flashinfer_timing(B, ctx, Hq, Hkv, D, q, dev, iters, env["max_bytes"], v.endswith("fp8"))
                     if dev.type == "cuda" else {"skipped": "CUDA only"})
            elif not kernel.available and dev.type == "cuda":
                r = {"skipped": kernel.name}
            else:
                r = filled_timing(kernel, B, ctx, Hq, Hkv, D, q, v[len("filled_"):], dev, iters, env["max_bytes"],
                                  configs.get((model, v)))
        except Exception as exc:  # noqa: BLE001 - out of memory, a kernel that rejects the shape: record it
            r = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            print(f"{model} B={B} ctx={ctx} {v}: {r['error'][:200]}", flush=True)
        r["wall_s"] = time.time() - t
        res[v] = r
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    derive(res, env["copy_bw"])
    return res


def sweep(args, env, rows: list) -> dict:
    """Every config (the kernel's default first) x sweep point x filled variant, appended to
    `rows`, config-major so that --sweep-budget-s cuts whole configs -> the best config per
    (model, variant): lowest geometric-mean ms over the points the default ran at."""
    kernel, dev = env["kernel"], env["dev"]
    if not kernel.available:
        rows.append({"skipped": kernel.name})
        return {}
    dtype, t0 = getattr(torch, args.dtype), time.time()
    configs = [None, *args.configs]
    cases = []  # (model, B, ctx, variant, q, layout): built once, timed under every config
    for spec in args.sweep_points:
        model, B, ctx = spec.split(":")
        B, ctx = int(B), int(ctx)
        Hq, Hkv, D = MODELS[model]
        q = torch.randn(B, Hq, D, dtype=dtype, device=dev)
        for v in [x for x in args.variants if x in FILLED]:
            cases.append((model, B, ctx, v, q, engine_layout_for(B, ctx, Hkv, D, q, v[len("filled_"):], dev,
                                                                  env["max_bytes"])))
    default_out = {}
    for i, cfg in enumerate(configs):
        if i and time.time() - t0 > args.sweep_budget_s:
            rows.append({"config": cfg, "skipped": f"--sweep-budget-s {args.sweep_budget_s} spent"})
            continue
        for model, B, ctx, v, q, layout in cases:
            Hq, Hkv, D = MODELS[model]
            row = {"model": model, "batch": B, "context": ctx, "variant": v,
                   "config": cfg if cfg is not None else "default"}
            try:
                r = filled_timing(kernel, B, ctx, Hq, Hkv, D, q, v[len("filled_"):], dev, args.iters or 10,
                                  env["max_bytes"], cfg, layout)
                out = kernel(q, layout.layer, layout.tables[0], config=kernel.make_config(cfg)).float()
                ref = default_out.setdefault((model, B, ctx, v), out)
                row.update(ms=r["ms"], bytes=r["bytes"], copies=r["copies"], graphed=r["graphed"],
                           pct_copy_bw=100 * r["bytes"] / (r["ms"] * 1e-3) / env["copy_bw"],
                           max_abs_diff_vs_default=float((out - ref).abs().max()))
            except Exception as exc:  # noqa: BLE001 - a config the kernel rejects
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
            print("sweep", {k: row[k] for k in row if k != "bytes"}, flush=True)
    del cases
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    best = {}
    for model in {r["model"] for r in rows if "model" in r}:
        for v in FILLED:
            sel = [r for r in rows if r.get("model") == model and r.get("variant") == v]
            points = {(r["batch"], r["context"]) for r in sel if r["config"] == "default" and "ms" in r}
            scores = {}
            for i, cfg in enumerate(configs):
                ms = [r["ms"] for r in sel if r["config"] == (cfg if cfg is not None else "default") and "ms" in r]
                if points and len(ms) == len(points):
                    scores[i] = math.exp(sum(math.log(m) for m in ms) / len(ms))
            if scores:
                best[(model, v)] = configs[min(scores, key=scores.get)]
    return best


def meta(args, env, rows, skipped, sweep_rows, best, partial) -> dict:
    return {
        "benchmark": "decode attention: engine tiered layout vs SDPA, fp16 paged decode, FlashInfer",
        "device": env["device"], "sm_count": env["sms"], "torch": torch.__version__,
        "triton": __import__("triton").__version__, "commit": git_commit(), "partial": partial,
        "params": {k: v for k, v in vars(args).items() if k not in ("plot_only",)},
        "filled_kernel": env["kernel"].name, "plan_error": env["kernel"].plan_error,
        "timing": "rotated input copies (>= 3x L2) in one CUDA graph, CUDA events, median replay / copies",
        "bytes": "K/V payload incl. per-token-head scales and zeros + q read + o written",
        "copy_bandwidth_Bps": env["copy_bw"], "results": rows, "skipped": skipped,
        "sweep": {"rows": sweep_rows, "best": [{"model": m, "variant": v, "config": c if c is not None else "default"}
                                               for (m, v), c in best.items()]} if args.sweep_configs else None,
    }


def run(args, on_update=None) -> dict:
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    props = torch.cuda.get_device_properties(dev) if cuda else None
    from filled_kernel import load_filled_kernel

    env = {"dev": dev, "device": props.name if cuda else device_name("cpu"), "sms": props.multi_processor_count
           if cuda else None, "kernel": load_filled_kernel(), "copy_bw": copy_bandwidth_Bps(dev),
           "max_bytes": int(0.25 * free_bytes(dev)) if cuda else (64 << 20)}
    print(f"device {env['device']}  copy {env['copy_bw'] / 1e12:.2f} TB/s  filled kernel: {env['kernel'].name}",
          flush=True)
    rows, skipped, sweep_rows, best = [], [], [], {}
    state = {"partial": True}

    def update():
        if on_update is not None:
            on_update(meta(args, env, rows, skipped, sweep_rows, best, state["partial"]))

    try:
        if args.sweep_configs:
            best.update(sweep(args, env, sweep_rows))
            update()
        configs = best if args.measure_config == "best" else {}
        for model in args.models:
            Hq, Hkv, D = MODELS[model]
            for B in args.batches:
                for ctx in args.contexts:
                    need = 2 * B * Hkv * ctx * D * torch.finfo(getattr(torch, args.dtype)).bits // 8
                    if B * ctx > args.max_tokens or 2.5 * need > 0.8 * free_bytes(dev):
                        skipped.append({"model": model, "batch": B, "context": ctx, "fp16_kv_bytes": need,
                                        "reason": "B * ctx > --max-tokens" if B * ctx > args.max_tokens else "memory"})
                        print(f"skip {model} B={B} ctx={ctx}: {skipped[-1]['reason']}", flush=True)
                        continue
                    t = time.time()
                    res = measure_point(args, env, model, B, ctx, configs)
                    rows.append(res)
                    print(f"{model} B={B} ctx={ctx} ({time.time() - t:.1f}s): " + "  ".join(
                        f"{v}={res[v]['ms'] * 1e3:.1f}us/{res[v].get('speed_vs_sdpa', 0):.2f}x/"
                        f"{res[v]['pct_copy_bw']:.0f}%" for v in args.variants if "ms" in res.get(v, {})), flush=True)
                    update()
    except KeyboardInterrupt:  # `timeout -s INT`: keep what was measured
        print("interrupted: writing the points measured so far", flush=True)
        return meta(args, env, rows, skipped, sweep_rows, best, True)
    state["partial"] = False
    return meta(args, env, rows, skipped, sweep_rows, best, False)


def summary(data: dict) -> str:
    """Markdown: speed vs SDPA (and % of SDPA's read bandwidth) of every variant at every point."""
    names = [v for v in ALL_VARIANTS if any("ms" in r.get(v, {}) for r in data["results"])]
    out = ["| model | batch | context | SDPA us | " + " | ".join(names[1:] if names[:1] == ["sdpa_fp16"] else names)
           + " |", "|---" * (4 + len(names) - (names[:1] == ["sdpa_fp16"])) + "|"]
    for r in data["results"]:
        cells = [f"{r[v]['speed_vs_sdpa']:.2f}x ({r[v]['pct_sdpa_bw']:.0f}%)" if "speed_vs_sdpa" in r.get(v, {})
                 else "-" for v in names if v != "sdpa_fp16"]
        sdpa = f"{r['sdpa_fp16']['ms'] * 1e3:.1f}" if "ms" in r.get("sdpa_fp16", {}) else "-"
        out.append(f"| {r['model']} | {r['batch']} | {r['context']} | {sdpa} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot(data: dict, path: str) -> bool:
    """Per model: speed vs SDPA and % of SDPA's read bandwidth over context, one column per batch."""
    rows = data["results"]
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    batches = sorted({r["batch"] for r in rows})
    variants = [v for v in ALL_VARIANTS if any("ms" in r.get(v, {}) for r in rows)]
    fig, axes = plt.subplots(2 * len(models), len(batches), figsize=(5 * len(batches), 3.6 * 2 * len(models)),
                             squeeze=False)
    for i, m in enumerate(models):
        for j, b in enumerate(batches):
            sel = sorted((r for r in rows if r["model"] == m and r["batch"] == b), key=lambda r: r["context"])
            for k, (key, label) in enumerate((("speed_vs_sdpa", "speed vs SDPA fp16 (x)"),
                                              ("pct_sdpa_bw", "% of SDPA read bandwidth"))):
                ax = axes[2 * i + k][j]
                for v in variants:
                    pts = [(r["context"], r[v][key]) for r in sel if key in r.get(v, {})]
                    if pts:
                        ax.plot(*zip(*pts), marker="o", label=v, ls="--" if not v.startswith("filled") else "-")
                ax.set_xscale("log", base=2)
                ax.set_title(f"{m}, batch {b}", fontsize=9)
                ax.set_xlabel("context (tokens)")
                ax.set_ylabel(label)
                ax.grid(True, which="both", alpha=0.3)
                ax.legend(fontsize=6)
    fig.suptitle(f"{data['device']} @ {str(data['commit'])[:10]}, copy {data['copy_bandwidth_Bps'] / 1e12:.2f} TB/s, "
                 f"{data.get('filled_kernel', '')[:60]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cpu: Triton's interpreter, perf_counter timing (a smoke run, not a measurement)")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--contexts", type=int, nargs="+", default=list(DEFAULT_CONTEXTS), help="in the order run")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=list(ALL_VARIANTS))
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    ap.add_argument("--iters", type=int, default=None, help="timed graph replays per variant (default 10-20)")
    ap.add_argument("--max-tokens", type=int, default=1 << 22, help="skip points with B * ctx above this")
    ap.add_argument("--sweep-configs", action="store_true", help="time --configs (and the default) first")
    ap.add_argument("--configs", type=json.loads, default=[],
                    help="JSON list of dicts, each passed as FilledDecodeConfig(**d)")
    ap.add_argument("--sweep-points", nargs="+", default=list(DEFAULT_SWEEP_POINTS), help="MODEL:BATCH:CONTEXT")
    ap.add_argument("--sweep-budget-s", type=float, default=120.0,
                    help="start no further config once the sweep has run this long")
    ap.add_argument("--measure-config", choices=["best", "default"], default="best",
                    help="after a sweep: measure with each (model, variant)'s best config or the defaults")
    ap.add_argument("--out-dir", default=None, help="where the JSON and PNG go (default benchmarks/results)")
    ap.add_argument("--name", default=None, help="result name (default attention_<device>)")
    ap.add_argument("--plot-only", default=None, help="re-plot an existing JSON")
    args = ap.parse_args(argv)
    if args.plot_only:
        with open(args.plot_only) as f:
            plot(json.load(f), args.plot_only.replace(".json", ".png"))
        return
    if not isinstance(args.configs, list) or not all(isinstance(c, dict) for c in args.configs):
        ap.error("--configs must be a JSON list of objects")
    for spec in args.sweep_points:
        parts = spec.split(":")
        if len(parts) != 3 or parts[0] not in MODELS or not (parts[1].isdigit() and parts[2].isdigit()):
            ap.error(f"--sweep-points: {spec!r} is not MODEL:BATCH:CONTEXT")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("no CUDA device: pass --device cpu (tiny shapes)")
    triton_interpreter_for(args.device)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    dev_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else device_name("cpu").split(" (")[0]
    name = args.name or f"attention_{dev_name.replace(' ', '_').replace('/', '_')}"

    def dump(d):
        return write_json(name, d, args.out_dir)

    data = run(args, on_update=dump)
    path = dump(data)
    print(summary(data))
    print("wrote", path)
    try:
        if plot(data, path.replace(".json", ".png")):
            print("wrote", path.replace(".json", ".png"))
    except Exception as exc:  # noqa: BLE001
        print("plot failed:", repr(exc))


if __name__ == "__main__":
    main()
