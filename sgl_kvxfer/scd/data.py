"""The SCD corpora: `{code,prose}_{train,calib,eval}.jsonl` ({"source", "text"} per line).

Found in $SGL_KVXFER_SCD_DATA, else ../shared/data next to the repo, else the repo's git-ignored
`.cache/scd_data` (what `scripts/gpu/scd_offline.sh prepare` writes for the GPU machine, where
../shared is absent; there the files may be gzipped: NAME.jsonl.gz is read as well).
"""
from __future__ import annotations

import gzip
import json
import os
import random

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPORA = ("code", "prose")
SPLITS = ("train", "calib", "eval")


def data_dir() -> str:
    from sgl_kvxfer import env as envs

    env = envs.SCD_DATA.get()
    for d in ([env] if env else []) + [envs.SHARED_DATA_DIR, os.path.join(REPO, ".cache", "scd_data")]:
        if d and os.path.isdir(d) and any(f.startswith("code_") for f in os.listdir(d)):
            return d
    raise FileNotFoundError("SCD corpora not found: set SGL_KVXFER_SCD_DATA or run "
                            "scripts/gpu/scd_offline.sh prepare")


def corpus_path(corpus: str, split: str) -> str:
    base = os.path.join(data_dir(), f"{corpus}_{split}.jsonl")
    for p in (base, base + ".gz"):
        if os.path.isfile(p):
            return p
    raise FileNotFoundError(f"no {corpus}_{split}.jsonl(.gz) in {data_dir()}")


def read_texts(path: str) -> list[str]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def token_chunks(tokenizer, texts: list[str], seq_len: int, max_chunks: int | None = None,
                 seed: int | None = None, max_per_doc: int | None = None) -> list[list[int]]:
    """Cut each text's tokens into non-overlapping windows of exactly `seq_len` tokens (a text
    shorter than that gives none), at most `max_per_doc` per text; shuffled with `seed` (None: in
    order), at most `max_chunks`."""
    chunks = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        doc = [ids[i:i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]
        chunks += doc[:max_per_doc] if max_per_doc else doc
    if seed is not None:
        random.Random(seed).shuffle(chunks)
    return chunks[:max_chunks] if max_chunks else chunks


def packed_chunks(tokenizer, texts: list[str], seq_len: int, eos_id: int, seed: int) -> list[list[int]]:
    """All texts joined with EOS and cut into `seq_len` windows (language-model training data)."""
    stream: list[int] = []
    for text in texts:
        stream += tokenizer(text, add_special_tokens=False)["input_ids"] + [eos_id]
    chunks = [stream[i:i + seq_len] for i in range(0, len(stream) - seq_len + 1, seq_len)]
    random.Random(seed).shuffle(chunks)
    return chunks
