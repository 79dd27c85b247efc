"""Fine-tune an HF-format causal LM on a mix of the task suite (sgl_kvxfer/tasks/); writes an HF
model directory that `python -m sgl_kvxfer.launch_server --model-path OUT` serves.

    python scripts/train/finetune.py --model smollm2-135m --mix qa=1 --out specialists/qa \\
        [--method full | --method lora --lora-rank 128] [--steps 2000] [--time-limit-s 90] \\
        [--batch-size 32] [--lr 1e-4] [--max-len 1024] [--task-param kv.context_tokens=2048] \\
        [--rope-theta T] [--rope-scaling '{"rope_type": "linear", "factor": 2.0}'] \\
        [--max-position-embeddings N] [--eval-n 100] [--seed 0] [--device auto]

Methods:
  full  (default) every weight trains (AdamW, fp32 master weights, bf16 autocast on a GPU). For
        a 135M-parameter model that is ~2 GB of optimizer state, and it is what makes a
        specialist really differ from its base (the SCD setting: a fine-tuned consumer whose
        K/V drift from the producer's), where low-rank adapters stay close to the base.
  lora  peft LoRA of rank --lora-rank (alpha = rank) on every projection, merged into the
        weights at the end (the output is a plain model dir either way): for models whose full
        optimizer state does not fit.

Schedule: linear warm-up, then cosine decay to 10% of --lr over the run's progress, where
progress = max(step / --steps, elapsed / --time-limit-s): the decay completes at whichever limit
comes first. Loss: cross-entropy on the answer tokens only (the prompt is the user turn of the
chat template, the answer the assistant turn). Seeded: data order, init of LoRA, dropout off.

Writes OUT/: config.json, model.safetensors (--save-dtype), tokenizer files, generation_config,
train_log.json (arguments, loss per step, steps run, tokens, wall time, device, eval scores on
--eval-n held-out items per task), loss.png.
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args(argv=None):
    from sgl_kvxfer import tasks

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF-format model dir (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--mix", required=True, help='task mix, e.g. "qa=2,code=1" (tasks: %s)' % ", ".join(tasks.task_names()))
    ap.add_argument("--out", required=True, help="output model dir")
    ap.add_argument("--method", choices=("full", "lora"), default="full")
    ap.add_argument("--lora-rank", type=int, default=128)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--time-limit-s", type=float, default=0.0, help="stop training after this long (0: no limit)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--max-len", type=int, default=1024, help="longer examples are skipped")
    ap.add_argument("--task-param", action="append", default=[], metavar="TASK.PARAM=VALUE")
    ap.add_argument("--rope-theta", type=float, default=None)
    ap.add_argument("--rope-scaling", default=None, help="JSON, e.g. '{\"rope_type\": \"linear\", \"factor\": 2.0}'")
    ap.add_argument("--max-position-embeddings", type=int, default=None)
    ap.add_argument("--grad-checkpointing", action="store_true")
    ap.add_argument("--eval-n", type=int, default=100, help="held-out items per task scored after training (0: none)")
    ap.add_argument("--eval-batch-size", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--save-dtype", choices=tuple(DTYPES), default="bfloat16")
    args = ap.parse_args(argv)
    bad = [n for n in ("steps", "batch_size", "grad_accum", "max_len", "lora_rank") if getattr(args, n) < 1]
    if bad:
        ap.error(f"--{bad[0].replace('_', '-')} must be >= 1")
    for n in ("lr", "time_limit_s", "weight_decay", "rope_theta"):
        v = getattr(args, n)
        if v is not None and (not math.isfinite(v) or v < 0 or (n == "lr" and v == 0)):
            ap.error(f"--{n.replace('_', '-')} must be a finite number {'> 0' if n == 'lr' else '>= 0'}")
    if args.eval_n < 0 or args.warmup < 0:
        ap.error("--eval-n and --warmup must be >= 0")
    try:
        args.mix_weights = tasks.parse_mix(args.mix)
        from task_data import parse_task_params

        args.task_params = parse_task_params(args.task_param)
        args.rope_scaling_dict = json.loads(args.rope_scaling) if args.rope_scaling else None
    except (ValueError, KeyError) as e:
        ap.error(str(e))
    if args.rope_scaling_dict is not None and not isinstance(args.rope_scaling_dict, dict):
        ap.error("--rope-scaling must be a JSON object")
    return args


def load(args, device: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    from sgl_kvxfer.models.loader import load_tokenizer, resolve_model_path, resolve_tokenizer_path

    src = resolve_model_path(args.model)
    config = AutoConfig.from_pretrained(src, local_files_only=True)
    if args.rope_theta is not None or args.rope_scaling_dict is not None:
        rope = dict(getattr(config, "rope_parameters", None) or {"rope_type": "default"})
        if args.rope_theta is not None:
            rope["rope_theta"] = args.rope_theta
        if args.rope_scaling_dict is not None:
            rope.update(args.rope_scaling_dict)
        config.rope_parameters = rope
    if args.max_position_embeddings:
        config.max_position_embeddings = args.max_position_embeddings
    model = AutoModelForCausalLM.from_pretrained(src, config=config, dtype=torch.float32, local_files_only=True)
    if args.method == "lora":
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=args.lora_rank, lora_alpha=args.lora_rank, lora_dropout=0.0,
                                                 target_modules=targets, bias="none", task_type="CAUSAL_LM"))
    if args.grad_checkpointing:
        model.gradient_checkpointing_enable()
    tok = load_tokenizer(resolve_tokenizer_path(src))
    return src, model.to(device), tok


def train(args, model, tok, device: str) -> dict:
    from task_data import Prefetcher, TaskStream
    from tqdm import tqdm

    stream = TaskStream(tok, args.mix_weights, args.task_params, args.seed, args.max_len)
    batches = Prefetcher(stream, args.batch_size)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95),
                            fused=device.startswith("cuda"))
    cuda = device.startswith("cuda")
    losses, tokens, seen, t0 = [], 0, {}, time.perf_counter()
    bar = tqdm(total=args.steps, desc=f"finetune {args.method} {args.mix}", unit="step")
    model.train()
    for step in range(args.steps):
        elapsed = time.perf_counter() - t0
        if args.time_limit_s and elapsed > args.time_limit_s:
            print(f"time limit {args.time_limit_s:g} s reached after {step} of {args.steps} steps", flush=True)
            break
        progress = max(step / args.steps, elapsed / args.time_limit_s if args.time_limit_s else 0.0)
        lr = args.lr * (min(1.0, (step + 1) / args.warmup) if step < args.warmup else
                        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
        for g in opt.param_groups:
            g["lr"] = lr
        total = 0.0
        for _ in range(args.grad_accum):
            ids, labels, mask, n_ans, names = batches.next()
            for t in names:
                seen[t] = seen.get(t, 0) + 1
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                loss = answer_loss(model, ids.to(device), mask.to(device), labels.to(device))
            (loss / args.grad_accum).backward()
            total += loss.item() / args.grad_accum
            tokens += int(mask.sum())
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(round(total, 5))
        bar.update()
        bar.set_postfix(loss=f"{total:.3f}", lr=f"{lr:.2e}")
    bar.close()
    batches.close()
    if cuda:
        torch.cuda.synchronize()
    return {"loss": losses, "steps_run": len(losses), "train_wall_s": round(time.perf_counter() - t0, 2),
            "tokens_seen": tokens, "examples_per_task": seen, "skipped_too_long": stream.skipped}


def answer_loss(model, ids, mask, labels):
    """Mean cross-entropy of the answer tokens. The LM head runs on the answer positions only
    (a few of each row's hundreds): with a 49k vocabulary that is most of a small model's
    logits cost and memory."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = base.model(input_ids=ids, attention_mask=mask).last_hidden_state
    target = labels[:, 1:]
    sel = target != -100
    logits = base.lm_head(hidden[:, :-1][sel]).float()
    return torch.nn.functional.cross_entropy(logits, target[sel])


def save(args, src: str, model, tok) -> None:
    """model: a plain transformers model (LoRA already merged)."""
    from transformers import GenerationConfig

    model = model.to(DTYPES[args.save_dtype])
    model.config.dtype = args.save_dtype
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    tok.save_pretrained(args.out)
    try:
        GenerationConfig.from_pretrained(src).save_pretrained(args.out)
    except OSError:
        pass
    for name in ("chat_template.jinja",):  # keep the source's chat template file if it has one
        p = os.path.join(src, name)
        if os.path.isfile(p) and not os.path.isfile(os.path.join(args.out, name)):
            with open(p) as f, open(os.path.join(args.out, name), "w") as g:
                g.write(f.read())


def main(argv=None) -> dict:
    args = parse_args(argv)
    from evaluate import score_model

    from benchmarks.common.report import device_name

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    torch.manual_seed(args.seed)
    src, model, tok = load(args, device)
    log = train(args, model, tok, device)
    if args.method == "lora":
        model = model.merge_and_unload()
    save(args, src, model, tok)
    if args.eval_n:
        model.to(DTYPES["bfloat16"] if device.startswith("cuda") else torch.float32)
        log["eval"] = score_model(model, tok, list(args.mix_weights), args.eval_n, args.seed, args.task_params,
                                  args.eval_batch_size)
    log.update({"base_model": src, "device": device_name(device), "command": " ".join(["python", *sys.argv]),
                "args": {k: v for k, v in vars(args).items() if k not in ("rope_scaling_dict",)}})
    with open(os.path.join(args.out, "train_log.json"), "w") as f:
        json.dump(log, f, indent=1)
    plot_loss(log["loss"], os.path.join(args.out, "loss.png"), f"{args.method} fine-tune on {args.mix}")
    scores = {t: {k: round(v, 4) for k, v in s.items()} for t, s in log.get("eval", {}).items() if t != "examples"}
    print(f"{args.out}: {log['steps_run']} steps in {log['train_wall_s']} s; eval {scores}", flush=True)
    return log


def plot_loss(losses: list[float], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("answer-token loss (nats)")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
