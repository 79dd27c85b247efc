"""Offline throughput: the same prompts through sgl_kvxfer's Engine and HF transformers `generate`.

Both sides generate exactly `--output-len` tokens per prompt (ignore_eos / min_new_tokens), on
the same prompts (real text from ../shared/data, cut to lengths uniform in the input range).
HF is batched as well as it allows: prompts sorted by length, left padding, at each
`--hf-batch-size` given; the ratio is against HF's fastest batch size. With `--repeats N` both
sides run N timed passes after their warm-up and report the median (every pass is in `run_s`).
On CUDA we also time decode steps and compare them with the weight+KV bandwidth roofline, and
compute the workload's lower bound at this GPU's measured GEMM rate and copy bandwidth
(`common/roofline.py`): the fastest any engine could finish, hence the largest ratio over HF
this device allows.

    python benchmarks/throughput/offline.py --num-prompts 256 --output-len 128
    python benchmarks/throughput/offline.py --model-preset llama-3-8b --load-format dummy --device cuda
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.report import RESULTS_DIR, device_name, git_commit, triton_interpreter_for, write_json  # noqa: E402
from common.roofline import copy_bandwidth, measure_offline_bound  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "shared", "data", "prose_eval.jsonl")


def make_prompts(tokenizer, num: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    text_ids: list[int] = []
    if os.path.exists(DATA):
        with open(DATA) as f:
            for line in f:
                text_ids.extend(tokenizer.encode(json.loads(line)["text"]))
                if len(text_ids) > hi * 8:
                    break
    else:  # ../shared does not travel to the GPU machine: fall back to this repo's docs
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        for name in ("README.md", "docs/structures.md", "docs/http_api.md", "sgl_kvxfer/mem_cache/README.md"):
            with open(os.path.join(root, name)) as f:
                text_ids.extend(tokenizer.encode(f.read()))
    prompts = []
    for _ in range(num):
        n = rng.randint(lo, hi)
        if len(text_ids) > n:
            start = rng.randrange(0, len(text_ids) - n)
            ids = [t % vocab for t in text_ids[start : start + n]]
        else:
            ids = [rng.randrange(10, vocab) for _ in range(n)]
        prompts.append(ids)
    return prompts


def run_engine(args, model_dir, prompts):
    from sgl_kvxfer import Engine

    kwargs = dict(load_format=args.load_format, device=args.device, dtype=args.dtype,
                  tokenizer_path=args.tokenizer_path, max_running_requests=args.max_running_requests,
                  attention_backend=args.attention_backend)
    if args.mem_fraction_static:
        kwargs["mem_fraction_static"] = args.mem_fraction_static
    if args.max_prefill_tokens:
        kwargs["max_prefill_tokens"] = args.max_prefill_tokens
    if args.enable_prefill_cuda_graph:
        kwargs["enable_prefill_cuda_graph"] = True
    engine = Engine(model_dir, **{k: v for k, v in kwargs.items() if v is not None})
    params = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
    # Warm-up over the same prompts with a few new tokens, so one-time Triton JIT compiles and
    # autotuning (per shape specialization) fall outside the timed run; the flush keeps the timed
    # run from hitting the radix cache.
    engine.generate(input_ids=prompts, sampling_params={**params, "max_new_tokens": 4})
    engine.flush_cache()
    times = []
    for _ in range(args.repeats):  # each timed run starts from an empty radix cache
        sync(args.device)
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        sync(args.device)
        times.append(time.perf_counter() - t0)
        engine.flush_cache()
    elapsed = statistics.median(times)
    out_tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    result = {"elapsed_s": elapsed, "run_s": times, "output_tokens": out_tokens,
              "output_tok_s": out_tokens / elapsed,
              "total_tok_s": (out_tokens + sum(map(len, prompts))) / elapsed,
              "max_running_requests": engine.runner.max_running_requests,
              "kv_pool_tokens": engine.runner.max_total_tokens}
    if args.device.startswith("cuda"):
        result["decode_step"] = decode_roofline(engine, prompts, args)
    dtype, arch = engine.runner.dtype, engine.runner.arch
    result["max_prefill_tokens"] = engine.server_args.scheduler.max_prefill_tokens
    graphs = engine.runner.prefill_graph_runner
    result["prefill_graph_replays"] = graphs.replays if graphs is not None else 0
    engine.shutdown()
    del engine
    import gc

    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()  # hand the KV pool back before HF allocates
    return result, dtype, arch


def decode_roofline(engine, prompts, args) -> dict:
    """Time pure decode steps at a fixed batch and compare with bytes moved / copy bandwidth."""
    from sgl_kvxfer.message import TokenizedGenerateReq
    from sgl_kvxfer.sampling.params import SamplingParams

    sched = engine.scheduler
    batch = min(args.roofline_batch, len(prompts))
    steps = 32
    params = SamplingParams.from_dict({"max_new_tokens": steps + 8, "temperature": 0, "ignore_eos": True})
    for i in range(batch):
        sched.handle(TokenizedGenerateReq(rid=f"roof{i}", input_ids=prompts[i], sampling=params))
    while sched.waiting or sched.chunked:
        sched.step()
    times = []
    for _ in range(steps):
        sync(args.device)
        t0 = time.perf_counter()
        sched.step()
        sync(args.device)
        times.append(time.perf_counter() - t0)
    while sched.has_work():
        sched.step()
    sched.take_outputs()
    runner = engine.runner
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    ctx = sum(len(p) + steps // 2 for p in prompts[:batch])
    kv_bytes = ctx * runner.kv_pool.bytes_per_token()
    copy_bw = copy_bandwidth()
    step = statistics.median(times)
    roofline = (weight_bytes + kv_bytes) / copy_bw
    return {"batch": batch, "median_step_s": step, "weight_bytes": weight_bytes, "kv_bytes": kv_bytes,
            "copy_bandwidth_Bps": copy_bw, "roofline_step_s": roofline, "fraction_of_roofline": roofline / step}


def run_hf(args, model_dir, prompts, dtype, batch_size: int):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if args.load_format == "dummy":
        config = LlamaConfig.from_pretrained(model_dir)
        with torch.device(args.device):
            model = LlamaForCausalLM(config).to(dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(args.device)
    model.eval()
    pad = 0
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))

    def generate(batch_ids):
        width = max(map(len, batch_ids))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch_ids], device=args.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch_ids], device=args.device)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.output_len,
                                 min_new_tokens=args.output_len, do_sample=False, pad_token_id=pad)
        return (out.shape[1] - width) * len(batch_ids)

    generate([prompts[i] for i in order[: batch_size]])  # warm-up: one full batch
    times = []
    for _ in range(args.repeats):
        sync(args.device)
        t0 = time.perf_counter()
        out_tokens = 0
        for s in range(0, len(order), batch_size):
            out_tokens += generate([prompts[i] for i in order[s : s + batch_size]])
        sync(args.device)
        times.append(time.perf_counter() - t0)
    elapsed = statistics.median(times)
    return {"elapsed_s": elapsed, "run_s": times, "output_tokens": out_tokens, "output_tok_s": out_tokens / elapsed,
            "total_tok_s": (out_tokens + sum(map(len, prompts))) / elapsed, "batch_size": batch_size}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


TARGET_RATIO = {"cuda": 10, "cpu": 3}  # the ratios over HF the engine aims at, drawn on the plot as a reference


def plot(path_png: str, payload: dict) -> None:
    """Bars: our Engine and HF's fastest batch. Lines: 10x HF, and (CUDA) the device ceiling,
    the throughput of the workload's lower-bound time (common/roofline.py)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ours, hf, bound, prm = payload["sgl_kvxfer"], payload["hf_generate"], payload.get("lower_bound"), payload["params"]
    fig, ax = plt.subplots(figsize=(5.4, 4.0))
    names = ["sgl_kvxfer Engine", f"HF generate (batch {hf['batch_size']})"]
    vals = [ours["output_tok_s"], hf["output_tok_s"]]
    bars = ax.bar(names, vals, color=["#2a7", "#888"])
    ax.bar_label(bars, fmt="%.1f")
    target = TARGET_RATIO["cuda" if prm["device"].startswith("cuda") else "cpu"]
    lines = [(target * hf["output_tok_s"], f"{target}x HF (target)", "#555", ":")]
    top = max(vals + [lines[0][0]]) * 1.15
    if bound:
        ceiling = bound["max_output_tok_s"]
        label = f"device ceiling {ceiling:.0f} tok/s = {ceiling / hf['output_tok_s']:.1f}x HF"
        if ceiling < 2 * top:
            lines.append((ceiling, label, "#c33", "--"))
            top = max(top, ceiling * 1.15)
        else:
            ax.text(0.5, 0.97, label + " (off scale)", color="#c33", ha="center", va="top", fontsize=8,
                    transform=ax.transAxes)
    for y, label, color, style in lines:
        ax.axhline(y, color=color, ls=style, lw=1)
        # over the HF bar, which always sits below both lines
        ax.text(0.75, y, label, color=color, ha="center", va="bottom", fontsize=8, transform=ax.get_yaxis_transform())
    ax.set_ylim(0, top)
    ax.set_ylabel("output tokens / s")
    model = prm.get("model_preset") or os.path.basename(prm["model_dir"].rstrip("/"))
    ax.set_title(f"{model}, commit {payload['commit'][:7]}: {payload['ratio_output_tok_s']:.2f}x HF\n"
                 f"{payload['device'].replace('(R)', '')}\n{prm['num_prompts']} prompts, "
                 f"in {prm['input_len_min']}-{prm['input_len_max']}, out {prm['output_len']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path_png, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="model dir; default: embedded SmolLM2-135M-Instruct")
    p.add_argument("--model-preset", default=None, help="write a preset config (e.g. llama-3-8b) for dummy weights")
    p.add_argument("--tokenizer-path", default=None,
                   help="tokenizer dir (default: the model dir's, else the embedded SmolLM2 one)")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len-min", type=int, default=128)
    p.add_argument("--input-len-max", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--hf-batch-size", type=int, nargs="+", default=[32],
                   help="HF generate batch size(s); with several, the ratio uses HF's fastest")
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--max-prefill-tokens", type=int, default=None, help="engine default: 16384")
    p.add_argument("--enable-prefill-cuda-graph", action="store_true",
                   help="replay prefill steps from CUDA graphs (engine/prefill_graph_runner.py)")
    p.add_argument("--roofline-batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=1,
                   help="timed runs per engine (and per HF batch size); throughput from the median")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default=None, help="suffix for the result file name")
    p.add_argument("--out-dir", default=RESULTS_DIR)
    p.add_argument("--replot", metavar="RESULT_JSON", default=None,
                   help="only redraw RESULT_JSON's PNG (next to it) and exit")
    args = p.parse_args()
    if args.replot:
        with open(args.replot) as f:
            plot(args.replot[:-5] + ".png", json.load(f))
        return

    triton_interpreter_for(args.device)
    from sgl_kvxfer.models.loader import resolve_model_path

    if args.model_preset:
        from sgl_kvxfer.models.presets import write_preset_config

        with tempfile.TemporaryDirectory(prefix="preset_") as tmp:
            run(args, write_preset_config(args.model_preset, tmp))
        return
    run(args, resolve_model_path(args.model_path))


def run(args, model_dir: str) -> None:
    from sgl_kvxfer.models.loader import load_tokenizer, resolve_tokenizer_path

    if args.model_preset:
        args.load_format = "dummy"
    tokenizer = load_tokenizer(resolve_tokenizer_path(model_dir, args.tokenizer_path))
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    prompts = make_prompts(tokenizer, args.num_prompts, args.input_len_min, args.input_len_max,
                           min(vocab, len(tokenizer)), args.seed)
    ours, dtype, arch = run_engine(args, model_dir, prompts)
    print(f"sgl_kvxfer: {ours['output_tok_s']:.1f} output tok/s ({ours['elapsed_s']:.1f} s)", flush=True)
    hf = None
    if not args.skip_hf:  # HF at every requested batch size; the ratio is against its fastest
        runs = [run_hf(args, model_dir, prompts, dtype, bs) for bs in args.hf_batch_size]
        for r in runs:
            print(f"HF generate at batch {r['batch_size']}: {r['output_tok_s']:.1f} output tok/s", flush=True)
        hf = max(runs, key=lambda r: r["output_tok_s"])
        hf = {**hf, "all_batch_sizes": runs}
    if hf:
        print(f"HF generate: {hf['output_tok_s']:.1f} output tok/s ({hf['elapsed_s']:.1f} s); "
              f"ratio {ours['output_tok_s'] / hf['output_tok_s']:.2f}x", flush=True)
    bound = None
    if args.device.startswith("cuda"):
        bound = measure_offline_bound(arch, [len(p) for p in prompts], args.output_len, dtype,
                                      prefill_rows=ours["max_prefill_tokens"])
        bound["max_output_tok_s"] = ours["output_tokens"] / bound["bound_s"]
        bound["fraction_reached"] = bound["bound_s"] / ours["elapsed_s"]
        if hf:
            bound["max_ratio_vs_hf"] = hf["elapsed_s"] / bound["bound_s"]
        print(f"lower bound at measured rates ({bound['flops_per_s'] / 1e12:.0f} TFLOP/s GEMM, "
              f"{bound['bytes_per_s'] / 1e12:.2f} TB/s copy): {bound['bound_s']:.3f} s, we reach "
              f"{bound['fraction_reached']:.0%} of it"
              + (f"; the largest ratio over HF it allows is {bound['max_ratio_vs_hf']:.2f}x" if hf else ""), flush=True)
    model_name = args.model_preset or os.path.basename(model_dir.rstrip("/"))
    name = f"offline_{model_name}_{args.device.split(':')[0]}" + (f"_{args.tag}" if args.tag else "")
    payload = {
        "benchmark": "offline_throughput", "device": device_name(args.device), "commit": git_commit(),
        # the host's speed moves small-model GPU results (their host work barely hides behind the GPU)
        "host_cpu": device_name("cpu"),
        "params": {**vars(args), "model_dir": model_dir, "dtype_resolved": str(dtype)},
        "sgl_kvxfer": ours, "hf_generate": hf, "lower_bound": bound,
        "ratio_output_tok_s": ours["output_tok_s"] / hf["output_tok_s"] if hf else None,
    }
    path = write_json(name, payload, args.out_dir)
    if hf:
        plot(path[:-5] + ".png", payload)
    print("wrote", path)


if __name__ == "__main__":
    main()
