"""Token data for FusedKV training, retrofit and conversion.

    python -m sgl_kvxfer.fusedkv.data --data-dir DIR --out .cache/fusedkv [--tokenizer MODEL_DIR]

A data folder holds `{domain}_{split}.jsonl` files (one {"text": ...} document a line; split in
train / calib / eval, any domain names, e.g. prose_train.jsonl, code_eval.jsonl), or the token
files `prepare` makes of them: one LZMA-compressed stream per file, `{domain}_{split}.u16.xz`
(uint32 `.u32.xz` when the vocabulary exceeds 2^16), every document followed by the tokenizer's
end-of-text id, plus meta.json naming the tokenizer by the sha256 of its vocabulary. A token
folder is what a GPU call carries (no raw corpora there). The folder comes from a flag or from
SGL_KVXFER_FUSEDKV_DATA; there is no built-in default path.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import re

import numpy as np
import torch

SPLITS = ("train", "calib", "eval")
_FILE = re.compile(r"^(?P<domain>[A-Za-z0-9-]+)_(?P<split>train|calib|eval)\.(?P<ext>jsonl|u16\.xz|u32\.xz)$")


def resolve_data_dir(flag: str | None) -> str:
    """The data folder from a flag, else SGL_KVXFER_FUSEDKV_DATA; a clear error when neither names
    a folder."""
    from sgl_kvxfer import env

    path = flag or env.FUSEDKV_DATA.get()
    if not path:
        raise SystemExit("no training data: pass --train-data DIR (or set SGL_KVXFER_FUSEDKV_DATA) with "
                         "{domain}_{train,calib,eval}.jsonl files or their token files")
    if not os.path.isdir(path):
        raise SystemExit(f"training data folder {path!r} does not exist")
    return path


def tokenizer_sha256(model_dir: str) -> str:
    """sha256 of the tokenizer's vocabulary (token -> id, added tokens included), sorted: equal for
    two tokenizer.json files that encode alike whatever their formatting."""
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json")).get_vocab(with_added_tokens=True)
    return hashlib.sha256(json.dumps(vocab, sort_keys=True).encode()).hexdigest()


def _files(data_dir: str) -> dict[tuple[str, str], str]:
    """{(domain, split): file name}, token files preferred over jsonl for the same pair."""
    out: dict[tuple[str, str], str] = {}
    for name in sorted(os.listdir(data_dir)):
        m = _FILE.match(name)
        if m and ((m["domain"], m["split"]) not in out or m["ext"] != "jsonl"):
            out[(m["domain"], m["split"])] = name
    return out


def _meta(data_dir: str) -> dict:
    path = os.path.join(data_dir, "meta.json")
    return json.load(open(path)) if os.path.isfile(path) else {}


def is_token_folder(data_dir: str) -> bool:
    """True when every data file is a token file and meta.json gives the vocabulary size: such a
    folder serves from-scratch training without any tokenizer (the ids are used as they are)."""
    files = _files(data_dir)
    return bool(files) and all(n.endswith(".xz") for n in files.values()) and "vocab_size" in _meta(data_dir)


class Tokenized:
    """One folder's documents as token arrays, tokenized with one model's tokenizer; model_dir None
    reads a token folder (is_token_folder) as it is, with meta.json's vocabulary size."""

    def __init__(self, data_dir: str, model_dir: str | None):
        from tokenizers import Tokenizer

        self.data_dir, self.model_dir = data_dir, model_dir
        self.files = _files(data_dir)
        if not self.files:
            raise SystemExit(f"{data_dir}: no {{domain}}_{{train,calib,eval}}.jsonl or token files")
        if model_dir is None:
            if not is_token_folder(data_dir):
                raise SystemExit(f"{data_dir}: without a tokenizer, every file must be a token file and "
                                 f"meta.json must give vocab_size")
            meta = _meta(data_dir)
            self.sha, self._tok, self.eot_id = meta.get("tokenizer_sha256"), None, meta.get("eot_id")
            self.vocab_size = int(meta["vocab_size"])
            return
        with open(os.path.join(model_dir, "config.json")) as f:
            self.vocab_size = int(json.load(f)["vocab_size"])
        self.sha = tokenizer_sha256(model_dir)
        self._tok = None
        if any(n.endswith(".xz") for n in self.files.values()):
            got = _meta(data_dir).get("tokenizer_sha256")
            if got != self.sha:
                raise SystemExit(f"{data_dir}: its token files were made with another tokenizer than {model_dir}'s "
                                 f"(meta.json tokenizer_sha256 {got}); pass the jsonl folder instead")
        self._tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        self.eot_id = self._eot(model_dir)

    def _eot(self, model_dir: str) -> int:
        """The id appended after every document: the tokenizer's <|endoftext|> when it has one,
        else the config's eos (the first of a list), else 0."""
        tid = self._tok.token_to_id("<|endoftext|>")
        if tid is not None:
            return int(tid)
        with open(os.path.join(model_dir, "config.json")) as f:
            eos = json.load(f).get("eos_token_id")
        return int(eos[0] if isinstance(eos, list) else (eos if eos is not None else 0))

    def domains(self, split: str) -> list[str]:
        return sorted(d for d, s in self.files if s == split)

    def tokens(self, domain: str, split: str) -> np.ndarray:
        name = self.files[(domain, split)]
        path = os.path.join(self.data_dir, name)
        if name.endswith(".xz"):
            with open(path, "rb") as f:
                return np.frombuffer(lzma.decompress(f.read()), dtype=np.uint16 if ".u16." in name else np.uint32)
        with open(path) as f:
            docs = [json.loads(line)["text"] for line in f if line.strip()]
        ids = [np.append(np.asarray(e.ids, dtype=np.uint32), np.uint32(self.eot_id)) for e in self._tok.encode_batch(docs)]
        return np.concatenate(ids) if ids else np.zeros(0, dtype=np.uint32)

    def split(self, split: str) -> dict[str, np.ndarray]:
        """{domain: tokens} of one split (every domain that has the file)."""
        out = {d: self.tokens(d, split) for d in self.domains(split)}
        if not out:
            raise SystemExit(f"{self.data_dir}: no *_{split} file")
        return out


def prepare(data_dir: str, out_dir: str, tokenizer_dir: str) -> dict:
    """Tokenize every {domain}_{split}.jsonl of data_dir into out_dir's token files; returns meta."""
    src = Tokenized(data_dir, tokenizer_dir)
    os.makedirs(out_dir, exist_ok=True)
    meta = {"tokenizer_sha256": src.sha, "eot_id": src.eot_id, "files": {}}
    with open(os.path.join(tokenizer_dir, "config.json")) as f:
        meta["vocab_size"] = int(json.load(f)["vocab_size"])
    dtype, ext = (np.uint16, "u16") if meta["vocab_size"] <= 1 << 16 else (np.uint32, "u32")
    for (domain, split), name in src.files.items():
        arr = src.tokens(domain, split).astype(dtype)
        with open(os.path.join(out_dir, f"{domain}_{split}.{ext}.xz"), "wb") as f:
            f.write(lzma.compress(arr.tobytes(), preset=6))
        meta["files"][f"{domain}_{split}"] = {"tokens": int(arr.size)}
        print(f"{domain}_{split}: {arr.size} tokens", flush=True)
    with open(os.path.join(out_dir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    return meta


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
    """Windows of every domain of a split, domains in turn (an even mix when capped)."""
    per = None if max_chunks is None else max(1, max_chunks // len(split))
    return torch.cat([chunks(t, seq_len, per) for t in split.values()])


class ShiftedWindows:
    """Training windows whose boundaries move from epoch to epoch: `cut(gen)` splits each
    domain's token stream into non-overlapping windows of seq_len + 1 tokens starting at a seeded
    offset in [0, seq_len) (0 for the first cut: the windows of mixed_chunks), so a later pass
    sees the same text with other contexts. Each domain may lose its last window to the offset."""

    def __init__(self, split: dict[str, np.ndarray], seq_len: int):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.split, self.seq_len, self._cuts = split, seq_len, 0
        for name, tokens in split.items():
            if tokens.size < 2 * seq_len + 1:
                raise ValueError(f"domain {name}: {tokens.size} tokens do not fill two windows of {seq_len + 1}")

    def cut(self, gen: torch.Generator) -> torch.Tensor:
        parts = []
        for tokens in self.split.values():
            offset = 0 if self._cuts == 0 else int(torch.randint(self.seq_len, (1,), generator=gen))
            parts.append(chunks(tokens[offset:], self.seq_len))
        self._cuts += 1
        return torch.cat(parts)


class EpochBatches:
    """Batches of windows, a fresh seeded permutation every epoch: every model that uses the
    same (windows, batch size, seed) sees the same tokens in the same order. `windows` a
    ShiftedWindows: each epoch cuts fresh windows first (same seed, same cuts)."""

    def __init__(self, windows: "torch.Tensor | ShiftedWindows", batch_size: int, seed: int = 0):
        self.gen = torch.Generator().manual_seed(seed)
        self.source = windows if isinstance(windows, ShiftedWindows) else None
        if self.source is not None:
            windows = self.source.cut(self.gen)
        if windows.shape[0] < batch_size:
            raise ValueError(f"{windows.shape[0]} windows < batch size {batch_size}")
        self.windows, self.batch_size = windows, batch_size
        self.per_epoch = windows.shape[0] // batch_size
        self._order, self._pos = None, self.per_epoch
        self._started = False
        self.epochs = 0.0

    def __next__(self) -> torch.Tensor:
        if self._pos >= self.per_epoch:
            if self.source is not None and self._started:  # the first epoch uses the first cut
                self.windows = self.source.cut(self.gen)
                self.per_epoch = max(1, self.windows.shape[0] // self.batch_size)
            self._started = True
            self._order, self._pos = torch.randperm(self.windows.shape[0], generator=self.gen), 0
        sel = self._order[self._pos * self.batch_size:(self._pos + 1) * self.batch_size]
        self._pos += 1
        self.epochs += 1 / self.per_epoch
        return self.windows[sel]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default=None, help="folder of {domain}_{split}.jsonl (default: $SGL_KVXFER_FUSEDKV_DATA)")
    ap.add_argument("--out", required=True, help="folder for the token files")
    ap.add_argument("--tokenizer", default=None, help="model dir with tokenizer.json (default: the embedded SmolLM2)")
    a = ap.parse_args(argv)
    if a.tokenizer is None:
        from sgl_kvxfer.models.loader import resolve_model_path

        a.tokenizer = resolve_model_path(None)
    prepare(resolve_data_dir(a.data_dir), a.out, a.tokenizer)


if __name__ == "__main__":
    main()
