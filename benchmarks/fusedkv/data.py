"""Token data for the FusedKV training and retrofit scripts.

    python benchmarks/fusedkv/data.py                       # ../shared/data -> .cache/fusedkv
    python benchmarks/fusedkv/data.py --data-dir D --out DIR --tokenizer MODEL_DIR

`prepare` tokenizes ../shared/data/{prose,code}_{train,calib,eval}.jsonl (one {"text": ...}
document a line) with SmolLM2's tokenizer (vocab 49152 < 2^16, so uint16), every document
followed by <|endoftext|> (id 0), and writes one LZMA-compressed uint16 stream per file,
`{domain}_{split}.u16.xz`, plus meta.json. The GPU machine has no ../shared: .cache/fusedkv
(git-ignored, ~4.5 MB for the 5.8M tokens of all six files) is what its call carries.
"""
from __future__ import annotations

import argparse
import json
import lzma
import os

import numpy as np
import torch

DOMAINS = ("prose", "code")
SPLITS = ("train", "calib", "eval")
EOT_ID = 0  # SmolLM2's <|endoftext|>
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_DIR = os.path.join(ROOT, ".cache", "fusedkv")
SHARED_DATA = os.path.join(os.path.dirname(ROOT), "shared", "data")


def prepare(data_dir: str = SHARED_DATA, out_dir: str = DEFAULT_DIR, tokenizer_dir: str | None = None) -> dict:
    """Tokenize every {domain}_{split}.jsonl found in data_dir into out_dir; returns meta."""
    from tokenizers import Tokenizer

    if tokenizer_dir is None:
        from sgl_kvxfer.models.loader import resolve_model_path

        tokenizer_dir = resolve_model_path(None)
    tok = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    if tok.get_vocab_size() > 1 << 16:
        raise ValueError(f"vocab {tok.get_vocab_size()} does not fit uint16")
    os.makedirs(out_dir, exist_ok=True)
    meta = {"tokenizer_dir": tokenizer_dir, "vocab_size": tok.get_vocab_size(), "eot_id": EOT_ID, "files": {}}
    for domain in DOMAINS:
        for split in SPLITS:
            src = os.path.join(data_dir, f"{domain}_{split}.jsonl")
            if not os.path.isfile(src):
                continue
            with open(src) as f:
                docs = [json.loads(line)["text"] for line in f if line.strip()]
            ids = [np.append(np.asarray(e.ids, dtype=np.uint16), np.uint16(EOT_ID)) for e in tok.encode_batch(docs)]
            arr = np.concatenate(ids) if ids else np.zeros(0, dtype=np.uint16)
            name = f"{domain}_{split}"
            with open(os.path.join(out_dir, name + ".u16.xz"), "wb") as f:
                f.write(lzma.compress(arr.tobytes(), preset=6))
            meta["files"][name] = {"documents": len(docs), "tokens": int(arr.size)}
            print(f"{name}: {len(docs)} documents, {arr.size} tokens")
    if not meta["files"]:
        raise FileNotFoundError(f"no {{prose,code}}_{{train,calib,eval}}.jsonl in {data_dir}")
    with open(os.path.join(out_dir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    return meta


def load_split(data_dir: str, split: str) -> dict[str, np.ndarray]:
    """{domain: uint16 tokens} of one split (domains whose file exists)."""
    out = {}
    for domain in DOMAINS:
        path = os.path.join(data_dir, f"{domain}_{split}.u16.xz")
        if os.path.isfile(path):
            with open(path, "rb") as f:
                out[domain] = np.frombuffer(lzma.decompress(f.read()), dtype=np.uint16)
    if not out:
        raise FileNotFoundError(f"no *_{split}.u16.xz in {data_dir}: run python benchmarks/fusedkv/data.py first")
    return out


def chunks(tokens: np.ndarray, seq_len: int, max_chunks: int | None = None) -> torch.Tensor:
    """Non-overlapping windows of seq_len + 1 tokens (input + shifted target), int64 [N, seq_len + 1]."""
    n = (tokens.size - 1) // seq_len
    if max_chunks is not None:
        n = min(n, max_chunks)
    if n <= 0:
        raise ValueError(f"{tokens.size} tokens do not fill one window of {seq_len + 1}")
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return torch.from_numpy(tokens[idx].astype(np.int64))


def mixed_chunks(split: dict[str, np.ndarray], seq_len: int, max_chunks: int | None = None) -> torch.Tensor:
    """Windows of every domain of a split, domains interleaved (an even mix when capped)."""
    per = None if max_chunks is None else max(1, max_chunks // len(split))
    parts = [chunks(t, seq_len, per) for t in split.values()]
    return torch.cat(parts)


class EpochBatches:
    """Batches of windows, a fresh seeded permutation every epoch: every model that uses the
    same (windows, batch size, seed) sees the same tokens in the same order."""

    def __init__(self, windows: torch.Tensor, batch_size: int, seed: int = 0):
        if windows.shape[0] < batch_size:
            raise ValueError(f"{windows.shape[0]} windows < batch size {batch_size}")
        self.windows, self.batch_size = windows, batch_size
        self.gen = torch.Generator().manual_seed(seed)
        self.per_epoch = windows.shape[0] // batch_size
        self._order, self._pos = None, self.per_epoch

    def __next__(self) -> torch.Tensor:
        if self._pos >= self.per_epoch:
            self._order, self._pos = torch.randperm(self.windows.shape[0], generator=self.gen), 0
        sel = self._order[self._pos * self.batch_size:(self._pos + 1) * self.batch_size]
        self._pos += 1
        return self.windows[sel]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default=SHARED_DATA)
    ap.add_argument("--out", default=DEFAULT_DIR)
    ap.add_argument("--tokenizer", default=None, help="model dir with tokenizer.json (default: embedded SmolLM2)")
    a = ap.parse_args()
    prepare(a.data_dir, a.out, a.tokenizer)


if __name__ == "__main__":
    main()
