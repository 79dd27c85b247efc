"""Score an HF-format model directory on the task suite's eval split (greedy, transformers).

    python scripts/train/evaluate.py --model DIR [--tasks qa,kv,needle,code] [--n 100] [--seed 0]
        [--task-param kv.context_tokens=2048 ...] [--batch-size 32] [--device auto] [--out FILE.json]

Prints {task: {metric: mean, "n": items}} (and writes it with --out, with a few examples).
`generate_answers` is what scripts/train/finetune.py calls after training.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sgl_kvxfer import tasks  # noqa: E402


@torch.no_grad()
def generate_answers(model, tokenizer, examples, batch_size: int = 32, progress=None) -> list[str]:
    """Greedy answers (left-padded batches, longest-first), in the examples' order."""
    device = next(model.parameters()).device
    prompts = [tasks.chat_prompt_ids(tokenizer, ex) for ex in examples]
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = [""] * len(prompts)
    was_training = model.training
    model.eval()
    for s in range(0, len(order), batch_size):
        idx = order[s:s + batch_size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        mask = torch.zeros(len(idx), width, dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]):] = 1
        new = max(tasks.get_task(examples[i].task).max_answer_tokens for i in idx)
        gen = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=new,
                             do_sample=False, pad_token_id=pad, eos_token_id=tokenizer.eos_token_id)
        for r, i in enumerate(idx):
            out[i] = tokenizer.decode(gen[r, width:], skip_special_tokens=True)
        if progress:
            progress(len(idx))
    model.train(was_training)
    return out


def eval_examples(mix_names, n: int, seed: int, tokenizer, task_params: dict) -> list:
    return [ex for t in mix_names for ex in tasks.generate(t, "eval", n, seed, tokenizer=tokenizer,
                                                             **task_params.get(t, {}))]


def score_model(model, tokenizer, names, n: int, seed: int, task_params: dict, batch_size: int) -> dict:
    from tqdm import tqdm

    examples = eval_examples(names, n, seed, tokenizer, task_params)
    bar = tqdm(total=len(examples), desc="eval", unit="q")
    preds = generate_answers(model, tokenizer, examples, batch_size, bar.update)
    bar.close()
    summary = tasks.evaluate(examples, preds)
    summary["examples"] = [{"task": ex.task, "answer": ex.answer, "pred": p}
                           for ex, p in list(zip(examples, preds))[::max(1, len(examples) // 8)]]
    return summary


def main(argv=None) -> dict:
    from task_data import parse_task_params
    from transformers import AutoModelForCausalLM

    from sgl_kvxfer.models.loader import load_tokenizer, resolve_model_path, resolve_tokenizer_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF-format model dir (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--tasks", default="qa,kv,needle,code")
    ap.add_argument("--n", type=int, default=100, help="eval items per task")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--task-param", action="append", default=[], metavar="TASK.PARAM=VALUE")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.n < 1 or args.batch_size < 1:
        ap.error("--n and --batch-size must be >= 1")
    names = list(tasks.parse_mix(args.tasks))
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    mdir = resolve_model_path(args.model)
    tok = load_tokenizer(resolve_tokenizer_path(mdir))
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(mdir, dtype=dtype, local_files_only=True).to(device)
    res = score_model(model, tok, names, args.n, args.seed, parse_task_params(args.task_param), args.batch_size)
    res["model"] = mdir
    print(json.dumps({t: v for t, v in res.items() if t in names}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
