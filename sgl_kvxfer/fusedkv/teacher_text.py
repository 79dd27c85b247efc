"""Teacher-sampled training text for the retrofit: more distinct windows than a small corpus holds.

    python -m sgl_kvxfer.fusedkv.teacher_text --model DIR --data DIR --tokens N \\
        [--prompt-tokens 32] [--new-tokens 480] [--temperature 1.0] [--batch 256] [--seed 0]

Distillation needs no labels, only inputs on which the student is to match the teacher. A
retrofit that passes many times over the same few million tokens ends up fitting those windows
(docs/fusedkv.md, `train_split_ppl`); this tool writes new ones. For each domain of the data
folder's train split it takes prompts of up to `--prompt-tokens` tokens at evenly spaced, seeded
offsets of that domain's training text (within one document), lets the original model continue each (sampling at
`--temperature` through the engine, to its end-of-text or `--new-tokens`) and stores prompt +
continuation + end-of-text as documents of a new domain `{domain}-teacher`, train split only, in
data.py's token-file format. `convert --train-data DIR` then trains on the corpus and the sampled
text together; the calib and eval splits, and so the held-out PPL, stay the corpus's.

`--data` must be a token folder made with this model's tokenizer (`python -m sgl_kvxfer.fusedkv.data`).
meta.json records each written file's tokens, the sampling settings and the seconds the sampling
took on which device: that time belongs to the retrofit's GPU time.
"""
from __future__ import annotations

import argparse
import json
import lzma
import os
import time

import numpy as np
import torch

SUFFIX = "-teacher"


def _prompts(tokens: np.ndarray, count: int, length: int, eot_id: int, rng: np.random.Generator) -> list[list[int]]:
    """`count` prompts of up to `length` tokens at evenly spaced offsets, each jittered within its
    stride, none crossing a document boundary: a window holding an end-of-text restarts right
    after its last one, and is cut at the next (a prompt of one document, never two)."""
    span = tokens.size - length
    if span <= 0:
        raise ValueError(f"{tokens.size} training tokens do not hold one prompt of {length}")
    stride = span / count
    starts = (np.arange(count) * stride + rng.uniform(0, stride, count)).astype(np.int64).clip(0, span)
    out = []
    for s in starts:
        ends = np.flatnonzero(tokens[s:s + length] == eot_id)
        if ends.size:
            s = min(s + int(ends[-1]) + 1, tokens.size - 1)
        window = tokens[s:s + length]
        cut = np.flatnonzero(window == eot_id)
        window = window[:cut[0]] if cut.size else window
        if window.size:
            out.append(window.astype(np.int64).tolist())
    if not out:
        raise ValueError("no prompt: the training text is end-of-text tokens only")
    return out


def sample_domain(engine, tokens: np.ndarray, target: int, eot_id: int, prompt_tokens: int, new_tokens: int,
                  temperature: float, batch: int, seed: int, bar=None, deadline: float = float("inf")) -> np.ndarray:
    """Documents (prompt + sampled continuation + eot) until they hold >= target tokens, or until
    time.perf_counter() passes `deadline` (checked between engine calls; at least one call runs)."""
    rng = np.random.default_rng(seed)
    docs, have, round_ = [], 0, 0
    while have < target and (round_ == 0 or time.perf_counter() < deadline):
        # enough prompts for what is left, at the longest continuation, in whole batches
        want = max(1, -(-(target - have) // (prompt_tokens + new_tokens + 1)))
        prompts = _prompts(tokens, min(batch, want), prompt_tokens, eot_id, rng)
        params = [{"max_new_tokens": new_tokens, "temperature": temperature,
                   "sampling_seed": (seed * 1_000_003 + round_ * batch + i) % (1 << 31)} for i in range(len(prompts))]
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        for p, out in zip(prompts, outs):
            ids = [t for t in out["output_ids"] if t != eot_id]
            doc = np.asarray(p + ids + [eot_id], dtype=np.int64)
            docs.append(doc)
            have += doc.size
            if bar is not None:
                bar.update(doc.size)
        round_ += 1
    return np.concatenate(docs)


def write_teacher_text(model_dir: str, data_dir: str, tokens: int, prompt_tokens: int = 32, new_tokens: int = 480,
                       temperature: float = 1.0, batch: int = 256, seed: int = 0, device: str = "cuda",
                       dtype: str = "auto", force: bool = False, progress: bool = True,
                       time_budget_s: float | None = None) -> dict:
    """Sample and write `{domain}-teacher_train` token files (tokens split evenly over the train
    domains; with time_budget_s, each domain also stops at its even share of the time left after
    the engine starts, and writes what it has); returns meta.json's `teacher_text` record."""
    from sgl_kvxfer import Engine
    from sgl_kvxfer.fusedkv.data import Tokenized, is_token_folder

    if not is_token_folder(data_dir):
        raise SystemExit(f"{data_dir}: not a token folder (make one: python -m sgl_kvxfer.fusedkv.data --data-dir "
                         f"JSONL_DIR --out {data_dir} --tokenizer {model_dir})")
    data = Tokenized(data_dir, model_dir)  # refuses token files of another tokenizer
    domains = [d for d in data.domains("train") if not d.endswith(SUFFIX)]
    if not domains:
        raise SystemExit(f"{data_dir}: no corpus train split to prompt from")
    meta_path = os.path.join(data_dir, "meta.json")
    with open(meta_path) as f:
        meta = json.load(f)
    ext, dtype_np = ("u16", np.uint16) if meta["vocab_size"] <= 1 << 16 else ("u32", np.uint32)
    names = {d: f"{d}{SUFFIX}_train.{ext}.xz" for d in domains}
    existing = [n for n in names.values() if os.path.exists(os.path.join(data_dir, n))]
    if existing and not force:
        raise SystemExit(f"{data_dir} already holds {existing}: pass --force to replace them")
    share = -(-tokens // len(domains))
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=share * len(domains), unit="tok", desc="teacher text", dynamic_ncols=True)
    record = {"model": os.path.basename(os.path.normpath(model_dir)), "tokenizer_sha256": data.sha,
              "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "temperature": temperature, "seed": seed,
              "files": {}}
    longest = prompt_tokens + new_tokens + 1
    t0 = time.perf_counter()
    # decode graphs for the whole batch (the engine's default captures up to 256 rows)
    graphs = {"cuda_graph_max_bs": batch} if str(device).startswith("cuda") else {}
    with Engine(model_dir, device=device, dtype=dtype, max_total_tokens=batch * longest + 4 * longest,
                chunked_prefill_size=max(512, prompt_tokens), context_length=longest + 64, **graphs) as engine:
        record["device"] = torch.cuda.get_device_name(0) if str(device).startswith("cuda") else "cpu"
        t_start, left = time.perf_counter(), None
        if time_budget_s is not None:
            left = time_budget_s - (t_start - t0)
        for k, d in enumerate(domains):
            deadline = float("inf") if left is None else t_start + left * (k + 1) / len(domains)
            arr = sample_domain(engine, data.tokens(d, "train"), share, data.eot_id, prompt_tokens, new_tokens,
                                temperature, batch, seed + k, bar, deadline)
            if arr.max(initial=0) >= meta["vocab_size"]:
                raise RuntimeError(f"sampled id {int(arr.max())} outside the vocabulary {meta['vocab_size']}")
            tmp = os.path.join(data_dir, names[d] + ".tmp")
            with open(tmp, "wb") as f:
                f.write(lzma.compress(arr.astype(dtype_np).tobytes(), preset=6))
            os.replace(tmp, os.path.join(data_dir, names[d]))  # a killed run leaves no half file
            record["files"][f"{d}{SUFFIX}_train"] = {"tokens": int(arr.size), "short_of_target": arr.size < share}
            meta.setdefault("files", {})[f"{d}{SUFFIX}_train"] = {"tokens": int(arr.size)}
    record["seconds"] = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    meta["teacher_text"] = record
    with open(meta_path, "w") as f:
        json.dump(meta, f, indent=2)
    return record


def _positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m sgl_kvxfer.fusedkv.teacher_text", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the original model (a dir or an embedded model name)")
    ap.add_argument("--data", required=True, help="the token folder to add {domain}-teacher_train files to")
    ap.add_argument("--tokens", type=_positive_int, required=True, help="tokens to sample, over all domains")
    ap.add_argument("--prompt-tokens", type=_positive_int, default=32)
    ap.add_argument("--new-tokens", type=_positive_int, default=480)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--batch", type=_positive_int, default=256, help="prompts per engine call")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--force", action="store_true", help="replace existing teacher files")
    ap.add_argument("--time-budget-s", type=float, default=None, help="stop sampling after this many seconds "
                    "(engine start included; each domain gets an even share) and write what was sampled")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    if not (a.temperature > 0 and a.temperature < 100):
        ap.error(f"--temperature must be in (0, 100), got {a.temperature}")
    if a.time_budget_s is not None and not (a.time_budget_s > 0 and a.time_budget_s < 1e7):
        ap.error(f"--time-budget-s must be a positive number of seconds, got {a.time_budget_s}")
    from sgl_kvxfer.models.loader import resolve_model_path
    from sgl_kvxfer.utils.triton_cpu import use_interpreter_on_cpu

    device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    use_interpreter_on_cpu(device)
    rec = write_teacher_text(resolve_model_path(a.model), a.data, a.tokens, a.prompt_tokens, a.new_tokens,
                             a.temperature, a.batch, a.seed, device, a.dtype, a.force, not a.no_progress,
                             a.time_budget_s)
    files = ", ".join(f"{n}: {v['tokens']} tokens" for n, v in rec["files"].items())
    print(f"wrote {files} in {rec['seconds']:.1f} s on {rec['device']}", flush=True)
    return rec


if __name__ == "__main__":
    main()
