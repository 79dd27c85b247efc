"""What FusedKV's halved pool buys a server at the device's memory limit: concurrent long requests
and decode throughput of vanilla, FusedKV and FusedKV-Lite of one shape (dummy weights).

Per variant, one Engine at the same --mem-fraction-static (the pool takes what the weights leave;
--pool-bytes instead gives every variant the same pool bytes, for CPU smoke runs),
then the same kind of request, as many as the pool holds: random prompts of --context tokens
that decode up to n2 tokens each.

    planned   pool tokens // (context + n2 + slack): the requests the pool can hold at once
    held      the largest decode batch the scheduler ran when that many requests arrived together
              (measured by a hook on the model runner: what it admitted, not what the arithmetic says)
    decode    decode_timing.measure_tpot over the held requests (radix-cached prompts: warm-up, then
              --repeats (n1, n2) pairs, median step with its spread); tokens/s = held / step
    bytes     each step against weights + KV read at the copy bandwidth measured here (decode_timing):
              a FusedKV top layer reads two source layers' K and V, so FusedKV reads 1.5x vanilla's
              KV bytes per token, Lite 1.0x. `bytes_model_throughput_ratio` is the ratio the bytes
              alone predict: held / step_bytes against vanilla's

    python benchmarks/fusedkv/capacity.py --preset llama-3-8b --context 32768      # GPU
    python benchmarks/fusedkv/capacity.py --smoke                                  # CPU smoke run, temp dir
"""
from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common.bandwidth import copy_bandwidth_Bps  # noqa: E402
from common.report import device_name, git_commit, triton_interpreter_for, write_json  # noqa: E402
from decode_timing import (SLACK, VARIANTS, kv_stored_bytes_per_token, measure_tpot, random_prompts,  # noqa: E402
                           step_roofline, sync, weight_bytes, write_variant)

TARGETS = {"held_ratio_min": 1.8, "throughput_ratio_min": 1.4}
SMOKE = ["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--backend", "torch", "--context", "48",
         "--pool-bytes", "614400", "--n1", "2", "--n2", "6", "--repeats", "5"]


class DecodeBatchSizes:
    """Records the batch size of every DECODE forward while active."""

    def __init__(self, engine):
        self.runner, self.sizes = engine.runner, []

    def __enter__(self):
        self._forward = self.runner.forward

        def forward(batch):
            if batch.mode.name == "DECODE":
                self.sizes.append(int(batch.batch_size))
            return self._forward(batch)

        self.runner.forward = forward
        return self

    def __exit__(self, *exc):
        self.runner.forward = self._forward


def run_variant(args, variant: str, model_dir: str, arch, copy_bw: float) -> dict:
    from sgl_kvxfer import Engine

    per_token = kv_stored_bytes_per_token(arch, args.dtype, variant)
    _, resident = weight_bytes(arch, args.dtype, variant)
    request = args.context + args.n2 + SLACK
    kw = dict(load_format="dummy", dtype=args.dtype, device=args.device, attention_backend=args.backend,
              max_running_requests=args.max_running, chunked_prefill_size=args.chunk, max_prefill_tokens=args.chunk)
    if args.device != "cpu":
        free, total = torch.cuda.mem_get_info()
        est = int((total * args.mem_fraction_static - resident - (total - free)) // per_token // request)
        kw.update(mem_fraction_static=args.mem_fraction_static, cuda_graph_max_bs=max(8, min(args.max_running, est + 8)))
    if args.pool_bytes:  # the same bytes for every variant, instead of the memory fraction
        kw["max_total_tokens"] = args.pool_bytes // per_token
    t0 = time.perf_counter()
    engine = Engine(model_dir, **kw)
    row = {"variant": variant, "engine_kwargs": kw, "engine_start_s": time.perf_counter() - t0,
           "kv_bytes_per_token": per_token, "weight_bytes_resident": resident, "request_tokens": request}
    try:
        pool = int(engine.get_server_info()["max_total_num_tokens"])
        planned = max(1, min(args.max_running, pool // request))
        row.update(pool_tokens=pool, pool_bytes=pool * per_token, planned=planned)
        prompts = random_prompts(planned, args.context, arch.vocab_size, seed=7)
        t = time.perf_counter()
        with DecodeBatchSizes(engine) as seen:
            engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": args.n1, "temperature": 0,
                                                                "ignore_eos": True})
        sync()
        row["fill_s"] = time.perf_counter() - t  # every prompt prefilled, n1 tokens decoded
        row["held"] = max(seen.sizes, default=0)
        print(f"{variant}: pool {pool} tokens ({pool * per_token / 2**30:.1f} GiB), planned {planned} x "
              f"{args.context}, held {row['held']} at once, fill {row['fill_s']:.1f} s", flush=True)
        held_prompts = prompts[: row["held"]] if row["held"] else prompts[:1]
        with DecodeBatchSizes(engine) as seen:
            row.update(measure_tpot(engine, held_prompts, args.n1, args.n2, args.repeats))
        row["timed_batch_sizes"] = sorted(set(seen.sizes))
        step_roofline(row, arch, args.dtype, variant, len(held_prompts), args.context, args.n1, args.n2, copy_bw)
        row["decode_tok_s"] = len(held_prompts) / row["tpot_s"] if row["tpot_s"] else None
        s = row["step_spread_s"]
        print(f"  decode step {s['median'] * 1e3:.2f} ms (min {s['min'] * 1e3:.2f}, max {s['max'] * 1e3:.2f}), "
              f"{row['decode_tok_s'] or 0:.1f} tok/s; bytes allow >= {row['min_step_s'] * 1e3:.2f} ms"
              + ("  FASTER THAN ITS BYTES ALLOW" if row["faster_than_bytes_allow"] else ""), flush=True)
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return row


def ratios(rows: dict[str, dict]) -> dict:
    base, out = rows.get("vanilla"), {}
    if not base or not base.get("held"):
        return out
    for v, r in rows.items():
        if v == "vanilla" or not r.get("held"):
            continue
        held = r["held"] / base["held"]
        tput = r["decode_tok_s"] / base["decode_tok_s"] if r.get("decode_tok_s") and base.get("decode_tok_s") else None
        model = (r["held"] / r["step_bytes"]) / (base["held"] / base["step_bytes"])
        out[v] = {"held": held, "decode_throughput": tput, "bytes_model_throughput_ratio": model,
                  "meets": {"held": held >= TARGETS["held_ratio_min"],
                            "throughput": tput is not None and tput >= TARGETS["throughput_ratio_min"]}}
    return out


def plot(path_png: str, title: str, rows: dict[str, dict], rel: dict) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = [v for v in rows if rows[v].get("held")]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4.2))
    ax[0].bar(names, [rows[v]["held"] for v in names], color=[f"C{i}" for i in range(len(names))])
    ax[0].set_ylabel("requests held at once")
    tput = [rows[v].get("decode_tok_s") or 0 for v in names]
    ax[1].bar(names, tput, color=[f"C{i}" for i in range(len(names))])
    ax[1].set_ylabel("decode tokens/s (held / median step)")
    for i, v in enumerate(names):
        if v in rel:
            ax[0].text(i, rows[v]["held"], f"{rel[v]['held']:.2f}x", ha="center", va="bottom")
            if rel[v]["decode_throughput"]:
                ax[1].text(i, tput[i], f"{rel[v]['decode_throughput']:.2f}x\n(bytes: {rel[v]['bytes_model_throughput_ratio']:.2f}x)",
                           ha="center", va="bottom", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path_png, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU smoke run into a temp dir: " + " ".join(SMOKE))
    p.add_argument("--preset", default="llama-3-8b")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--mem-fraction-static", type=float, default=0.88)
    p.add_argument("--pool-bytes", type=int, default=None,
                   help="cap every variant's pool at these bytes (CPU smoke runs; GPU: the memory fraction)")
    p.add_argument("--max-running", type=int, default=256)
    p.add_argument("--n1", type=int, default=4)
    p.add_argument("--n2", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", default="triton")
    p.add_argument("--out-dir", default=None, help="default benchmarks/results (--smoke: a fresh temp dir)")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    if args.smoke:
        args = p.parse_args(SMOKE + [a for a in argv if a != "--smoke"])
        args.out_dir = args.out_dir or tempfile.mkdtemp(prefix="fusedkv_capacity_smoke_")
    if not 1 <= args.n1 < args.n2 or args.repeats < 5 or not 0 < args.mem_fraction_static < 1 or args.context < 1:
        p.error("need 1 <= --n1 < --n2, --repeats >= 5, --mem-fraction-static in (0, 1), --context >= 1")
    triton_interpreter_for(args.device)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # `timeout -s INT`: keep what ran

    from sgl_kvxfer.models.arch_config import ModelArchConfig
    from sgl_kvxfer.models.presets import PRESETS

    arch = ModelArchConfig.from_hf_dict(PRESETS[args.preset])
    device = device_name(args.device)
    copy_bw = copy_bandwidth_Bps(torch.device(args.device))
    print(f"{device}: copy bandwidth {copy_bw / 1e9:.1f} GB/s (read + write)", flush=True)
    rows, partial = {}, True
    tag = "cpu" if args.device == "cpu" else device.split(" (")[0].replace(" ", "_")
    name = f"fusedkv_capacity_{args.preset}_{tag}"

    def payload() -> dict:
        return {"benchmark": "fusedkv_capacity", "device": device, "commit": git_commit(), "torch": torch.__version__,
                "params": vars(args), "copy_bandwidth_Bps": copy_bw, "targets": TARGETS, "partial": partial,
                "rows": rows, "vs_vanilla": ratios(rows)}

    try:
        with tempfile.TemporaryDirectory(prefix="fusedkv_capacity_") as root:
            for variant in args.variants:
                rows[variant] = run_variant(args, variant, write_variant(args.preset, variant, root), arch, copy_bw)
                write_json(name, payload(), args.out_dir)
        partial = False
    except KeyboardInterrupt:
        print("interrupted: writing the variants measured so far", flush=True)
    path = write_json(name, payload(), args.out_dir)
    rel = ratios(rows)
    for v, r in rel.items():
        print(f"{v} vs vanilla: held {r['held']:.2f}x, decode throughput "
              f"{r['decode_throughput'] if r['decode_throughput'] is None else round(r['decode_throughput'], 3)}x "
              f"(the bytes alone: {r['bytes_model_throughput_ratio']:.2f}x); meets {r['meets']}", flush=True)
    print("wrote", path)
    if plot(path[:-5] + ".png", f"at the memory limit: {args.context}-token requests, {args.preset} shape, "
            f"dummy weights, {args.dtype}, {device}", rows, rel):
        print("wrote", path[:-5] + ".png")
    return path


if __name__ == "__main__":
    main()
