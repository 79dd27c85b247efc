"""Fine-tune a specialist of SmolLM2-135M-Instruct: LoRA on every projection (peft), causal LM loss
on one corpus. The adapter (a few MB of safetensors) is what the repo keeps; the engine serves
base + adapter with `--merge-lora DIR` (sgl_kvxfer/models/lora.py).

    python scripts/scd/train_specialist.py --name code --data code      # -> scripts/scd/specialists/code/
    python scripts/scd/train_specialist.py --name prose --data prose

Writes OUT/adapter_model.safetensors (stored in --save-dtype), adapter_config.json,
train_log.json (seed, data, hyper-parameters, loss per step, wall time, device) and loss.png.
Deterministic for a fixed --seed on a given device (data order, LoRA init, dropout off).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", required=True, help="specialist name (output dir name)")
    ap.add_argument("--data", required=True, help="corpus name (code | prose: <corpus>_train.jsonl) or a .jsonl(.gz) path")
    ap.add_argument("--model", default=None, help="base model dir (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--out-dir", default=None, help="default scripts/scd/specialists/<name>")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="bfloat16", choices=tuple(DTYPES), help="base weights' dtype while training")
    ap.add_argument("--save-dtype", default="bfloat16", choices=tuple(DTYPES), help="adapter tensors on disk")
    ap.add_argument("--time-budget-s", type=float, default=0.0,
                    help="stop after this many seconds of training (0: none); the log records the steps run")
    return ap.parse_args(argv)


def build(args):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from sgl_kvxfer.models.loader import resolve_model_path

    model_dir = resolve_model_path(args.model)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[args.dtype], local_files_only=True)
    lcfg = LoraConfig(r=args.rank, lora_alpha=args.alpha, lora_dropout=0.0, target_modules=TARGETS,
                      bias="none", task_type="CAUSAL_LM")
    return model_dir, get_peft_model(base, lcfg)


def main(argv=None) -> str:
    args = parse_args(argv)
    from tqdm import tqdm

    from sgl_kvxfer.models.loader import load_tokenizer, resolve_tokenizer_path
    from sgl_kvxfer.scd.data import corpus_path, packed_chunks, read_texts

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    torch.manual_seed(args.seed)
    model_dir, model = build(args)
    model.to(device).train()
    tok = load_tokenizer(resolve_tokenizer_path(model_dir))
    path = args.data if args.data.endswith((".jsonl", ".gz")) else corpus_path(args.data, "train")
    chunks = packed_chunks(tok, read_texts(path), args.seq_len, tok.eos_token_id, args.seed)
    need = args.steps * args.batch_size  # windows drawn (recomputed from the steps actually run)
    if not chunks:
        raise SystemExit(f"{path}: no {args.seq_len}-token window")
    data = torch.tensor(chunks, dtype=torch.long)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)

    def lr_at(step):  # linear warm-up, cosine decay to 10%
        if step < args.warmup:
            return (step + 1) / args.warmup
        t = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    losses, t0 = [], time.perf_counter()
    bar = tqdm(range(args.steps), desc=f"train {args.name}", unit="step")
    for step in bar:
        idx = torch.arange(step * args.batch_size, (step + 1) * args.batch_size) % len(data)
        batch = data[idx].to(device)
        out = model(input_ids=batch, labels=batch)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
        if args.time_budget_s and time.perf_counter() - t0 > args.time_budget_s:
            print(f"time budget {args.time_budget_s} s reached after {step + 1} of {args.steps} steps")
            break
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    need = len(losses) * args.batch_size
    out_dir = args.out_dir or os.path.join(ROOT, "scripts", "scd", "specialists", args.name)
    save_adapter(model, out_dir, DTYPES[args.save_dtype])
    log = {"name": args.name, "data": os.path.basename(path), "base_model": os.path.basename(model_dir.rstrip("/")),
           "device": _device_name(device), "train_wall_s": round(wall, 2), "tokens_seen": need * args.seq_len,
           "epochs": round(need / len(data), 3), "train_windows": len(data),
           "trainable_params": sum(p.numel() for p in params), "steps_run": len(losses),
           "params": {k: v for k, v in vars(args).items()},
           "loss": [round(x, 5) for x in losses], "command": " ".join(["python", *sys.argv])}
    with open(os.path.join(out_dir, "train_log.json"), "w") as f:
        json.dump(log, f, indent=1)
    plot_loss(losses, os.path.join(out_dir, "loss.png"), f"{args.name}: LoRA r={args.rank} on {log['data']}")
    print(f"{args.name}: {len(losses)} steps in {wall:.1f}s, loss {losses[0]:.3f} -> {losses[-1]:.3f}; {out_dir}")
    return out_dir


def save_adapter(model, out_dir: str, dtype: torch.dtype) -> None:
    """peft's save_pretrained, then the tensors re-stored in `dtype` (a bf16 r=8 adapter of every
    projection of SmolLM2-135M is ~4.9 MB)."""
    from safetensors.torch import load_file, save_file

    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    if os.path.isfile(os.path.join(out_dir, "README.md")):  # peft's model-card boilerplate
        os.remove(os.path.join(out_dir, "README.md"))
    path = os.path.join(out_dir, "adapter_model.safetensors")
    tensors = {k: v.to(dtype).contiguous() for k, v in load_file(path).items()}
    save_file(tensors, path, metadata={"format": "pt"})


def plot_loss(losses: list[float], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, lw=1, label="loss")
    w = max(1, len(losses) // 20)
    if len(losses) > w:
        smooth = [sum(losses[i - w:i]) / w for i in range(w, len(losses) + 1)]
        ax.plot(range(w, len(losses) + 1), smooth, lw=2, label=f"mean of {w}")
    ax.set_xlabel("step")
    ax.set_ylabel("causal LM loss (nats/token)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _device_name(device: str) -> str:
    from benchmarks.common.report import device_name

    return device_name(device)


if __name__ == "__main__":
    main()
