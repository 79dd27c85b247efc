"""Model path resolution, weight loading and dtype policy. Never downloads from the hub.

    resolve_model_path   None / "smollm2-135m" / *.gguf / local dir  -> local HF-format dir
    resolve_tokenizer_path  model dir without tokenizer -> embedded SmolLM2 tokenizer
    load_model           dir + load_format (+ a LoRA adapter merged in) -> (model, ModelArchConfig)
    load_tokenizer       local dir -> HF AutoTokenizer
"""
from __future__ import annotations

import glob
import hashlib
import logging
import os
from typing import Iterator

import torch

from sgl_kvxfer.models import create_model
from sgl_kvxfer.models.arch_config import ModelArchConfig
from sgl_kvxfer.models.convert import is_converted, EMBEDDED_NAMES, convert_gguf, default_cache_dir, embedded_gguf_path

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
_DTYPES = {
    "half": torch.float16,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float": torch.float32,
    "float32": torch.float32,
}


def _is_embedded_name(model_path: str) -> bool:
    """A name of the embedded model (bare, or hub-style "org/name"), not a local directory
    that happens to be called that (a preset config dir named "smollm2-135m" is a model dir)."""
    if os.path.isdir(os.path.expanduser(model_path)):
        return False
    return model_path.lower().rstrip("/").split("/")[-1] in EMBEDDED_NAMES


def resolve_model_path(model_path: str | None, cache_dir: str | None = None) -> str:
    """Map a user model spec to a local HF-format directory (converting GGUF once).

    cache_dir: where a converted model lives; defaults to $SGL_KVXFER_MODEL_CACHE/<name>
    or ~/.cache/sgl_kvxfer/models/<name>.
    """
    if model_path is None or _is_embedded_name(model_path):
        out = cache_dir or default_cache_dir("smollm2-135m-instruct")
        if is_converted(out):  # an existing cache needs no GGUF (e.g. on the GPU machine)
            return out
        return convert_gguf(embedded_gguf_path(), out)
    path = os.path.abspath(os.path.expanduser(model_path))
    if path.lower().endswith(".gguf"):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"GGUF file not found: {model_path}")
        stem = os.path.splitext(os.path.basename(path))[0].lower()
        tag = hashlib.sha1(path.encode()).hexdigest()[:8]  # same stem, different file -> no clash
        return convert_gguf(path, cache_dir or default_cache_dir(f"{stem}-{tag}"))
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return path
        if os.path.isfile(os.path.join(path, "adapter_config.json")):
            raise FileNotFoundError(
                f"{model_path} is a LoRA adapter, not a model: serve its base model with the adapter merged, "
                f"--model-path {_adapter_base(path)} --merge-lora {model_path}")
        raise FileNotFoundError(f"Model directory has no config.json: {model_path}")
    raise FileNotFoundError(
        f"Model path not found: {model_path} (sgl_kvxfer never downloads from the hub; pass a local "
        f"directory, a .gguf file, or 'smollm2-135m' for the embedded default)"
    )


def _adapter_base(adapter_dir: str) -> str:
    """The base model an adapter names (adapter_config.json) when that is a local dir, else a
    placeholder for the user to fill in."""
    import json

    try:
        with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
            base = json.load(f).get("base_model_name_or_path")
    except (OSError, ValueError):
        base = None
    return base if isinstance(base, str) and os.path.isdir(base) else "<its base model dir>"


def resolve_tokenizer_path(model_dir: str, tokenizer_path: str | None = None) -> str:
    """Explicit tokenizer_path wins (resolved like a model path); else model_dir if it holds
    tokenizer files; else the embedded SmolLM2 tokenizer (for dummy-weight preset dirs,
    whose token ids may exceed that vocab, which is fine for speed work)."""
    if tokenizer_path is not None:
        if _is_embedded_name(tokenizer_path):
            return resolve_model_path(tokenizer_path)
        path = os.path.abspath(os.path.expanduser(tokenizer_path))
        if not os.path.isdir(path):
            raise FileNotFoundError(f"Tokenizer path not found: {tokenizer_path}")
        return path
    if any(os.path.isfile(os.path.join(model_dir, f)) for f in _TOKENIZER_FILES):
        return model_dir
    logger.info("No tokenizer in %s; using the embedded SmolLM2 tokenizer", model_dir)
    return resolve_model_path(None)


def load_tokenizer(tokenizer_dir: str):
    """AutoTokenizer's tokenizer for the folder, its class choice cached (utils/tokenizer_loading.py)."""
    from sgl_kvxfer.utils.tokenizer_loading import load_tokenizer as load

    return load(tokenizer_dir)


def resolve_dtype(dtype_str: str, arch_config: ModelArchConfig, device: str) -> torch.dtype:
    """SGLang semantics: "auto" -> bf16 for bf16 checkpoints, else fp16; on CPU "auto" is fp32
    (CPU half matmuls are slow and tests want fp32 exactness)."""
    if dtype_str in _DTYPES:
        return _DTYPES[dtype_str]
    if dtype_str != "auto":
        raise ValueError(f"Unknown dtype {dtype_str!r}; choose auto or one of {sorted(_DTYPES)}")
    if str(device).startswith("cpu"):
        return torch.float32
    ckpt = str(arch_config.torch_dtype or "float32").replace("torch.", "")
    return torch.bfloat16 if ckpt == "bfloat16" else torch.float16


def _iter_safetensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"No *.safetensors in {model_dir} (use --load-format dummy for random weights)")
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int, std: float = 0.02) -> None:
    """Deterministic random init: matrices/embeddings ~ N(0, std), norm weights = 1, biases = 0."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.normal_(0.0, std, generator=gen)


def load_model(
    model_dir: str, load_format: str, dtype: torch.dtype, device: str, seed: int,
    merge_lora: str | None = None,
) -> tuple[torch.nn.Module, ModelArchConfig]:
    """Build the model from `model_dir/config.json` and fill its weights.

    load_format: "auto" | "safetensors" read every *.safetensors shard; "gguf" expects
    `model_dir` already converted by `resolve_model_path`; "dummy" needs only config.json.
    merge_lora: a peft LoRA adapter dir merged into the weights as they load (models/lora.py).
    """
    arch_config = ModelArchConfig.from_dir(model_dir)
    model = create_model(arch_config, dtype, device)
    if load_format == "dummy":
        if merge_lora:
            raise ValueError("--merge-lora needs real weights, not --load-format dummy")
        init_dummy_weights(model, seed)
    elif load_format in ("auto", "safetensors", "gguf"):
        weights = _iter_safetensors(model_dir)
        if merge_lora:
            from sgl_kvxfer.models.lora import merged_weights

            weights = merged_weights(weights, os.path.expanduser(merge_lora))
        model.load_weights(weights)
    else:
        raise ValueError(f"Unknown load_format {load_format!r}")
    finish = getattr(model, "finish_load", None)  # variants with non-parameter state (FusedKV)
    if finish is not None:
        finish(load_format)
    return model, arch_config
