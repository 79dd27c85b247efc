"""Host (scheduler) time of the offline workload with the model taken out: the forward is a
stub that returns tiny logits at once, so what remains is the Python and torch-dispatch work
around each step (admission, KV allocation, prefix cache, batch packing, finish checks,
outputs). On a GPU this work must stay under the forward's GPU time to keep the GPU busy
(decode overlaps it with the next step; prefill does not), so it is tracked on its own, on CPU.

Reports seconds per phase and per decode step, median of `--repeats` runs after a warm-up.

    python benchmarks/throughput/host_overhead.py --num-prompts 256 --output-len 128
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.report import RESULTS_DIR, device_name, git_commit, write_json  # noqa: E402
from throughput.offline import make_prompts  # noqa: E402
from throughput.phase_profile import StepMarks  # noqa: E402


def one_layer_copy(model_dir: str) -> str:
    """The model's config and tokenizer with a single layer (dummy weights load fast)."""
    out = tempfile.mkdtemp(prefix="host_overhead_")
    for name in os.listdir(model_dir):
        if not name.endswith((".safetensors", ".gguf", ".bin")):
            shutil.copy(os.path.join(model_dir, name), out)
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = 1
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    return out


def plot(path_png: str, med: dict, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    left = 0.0
    for key, color in (("extend_s", "#47a"), ("decode_s", "#2a7"), ("outside_s", "#aaa")):
        ax.barh([0], [med[key]], left=left, color=color, label=f"{key[:-2]} {med[key]:.3f} s")
        left += med[key]
    ax.set_yticks([])
    ax.set_xlabel("host seconds (model forward stubbed out)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path_png, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len-min", type=int, default=128)
    p.add_argument("--input-len-max", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="run the overlapped decode path (the CUDA default) on CPU")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default=None)
    p.add_argument("--out-dir", default=RESULTS_DIR)
    args = p.parse_args()

    from sgl_kvxfer import Engine
    from sgl_kvxfer.models.loader import load_tokenizer, resolve_model_path

    model_dir = one_layer_copy(resolve_model_path(args.model_path))
    try:
        tokenizer = load_tokenizer(model_dir)
        with open(os.path.join(model_dir, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        prompts = make_prompts(tokenizer, args.num_prompts, args.input_len_min, args.input_len_max,
                               min(vocab, len(tokenizer)), args.seed)
        engine = Engine(model_dir, load_format="dummy", device="cpu", dtype="float32",
                        max_running_requests=args.num_prompts)
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    engine.scheduler.overlap = args.overlap
    engine.runner.forward = lambda batch: torch.zeros(batch.logits_positions.numel(), 4)  # token 0
    params = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
    runs = []
    for i in range(args.repeats + 1):  # the first is the warm-up
        with StepMarks(engine.scheduler) as rec:
            t0 = time.perf_counter()
            engine.generate(input_ids=prompts, sampling_params=params)
            total = time.perf_counter() - t0
        engine.flush_cache()
        times, steps = rec.phase_totals()
        if i:
            runs.append({"total_s": total, "extend_s": times["extend"], "decode_s": times["decode"],
                         "outside_s": total - times["extend"] - times["decode"],
                         "extend_steps": steps["extend"], "decode_steps": steps["decode"]})
    engine.shutdown()
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    med["decode_step_ms"] = 1e3 * med["decode_s"] / max(med["decode_steps"], 1)
    print(f"host only ({'overlap' if args.overlap else 'plain'} decode), median of {args.repeats}: total "
          f"{med['total_s']:.3f} s | extend {med['extend_s']:.3f} s in {med['extend_steps']:.0f} steps | decode "
          f"{med['decode_s']:.3f} s ({med['decode_step_ms']:.2f} ms/step) | outside {med['outside_s']:.3f} s")
    payload = {"benchmark": "host_overhead", "device": device_name("cpu"), "commit": git_commit(),
               "params": vars(args), "median": med, "runs": runs}
    name = "host_overhead_cpu" + (f"_{args.tag}" if args.tag else "")
    path = write_json(name, payload, args.out_dir)
    plot(path[: -len(".json")] + ".png", med, f"{args.num_prompts} prompts, {args.output_len} out, "
         f"{med['decode_step_ms']:.2f} ms host per decode step ({device_name('cpu')})")
    print("wrote", path)


if __name__ == "__main__":
    main()
