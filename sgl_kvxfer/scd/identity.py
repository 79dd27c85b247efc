"""Who a model is: the (config hash, weight hash) pair that SCD artifacts are bound to.

    config_hash  sha256 of the architecture fields of `ModelArchConfig` (not of config.json's
                 bytes: a transformers upgrade that rewrites config.json keeps the hash)
    weight_hash  sha256 over the tensors of the model dir's *.safetensors (name, dtype, shape and
                 bytes, sorted by name: file layout and metadata do not count), then, for a base +
                 LoRA consumer, the adapter's tensors and its merge parameters (r, lora_alpha,
                 use_rslora) -- not adapter_config.json's bytes, which carry peft's version.
                 "*" matches any weights (random artifacts for timing-only runs).

Hashing reads every weight byte once (~1 s per GB); results are cached per process by
(path, size, mtime).
"""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
from dataclasses import dataclass

WILDCARD = "*"
_FILE_CACHE: dict[tuple[str, int, int], str] = {}


@dataclass(frozen=True)
class ModelIdentity:
    """One side of an SCD pair. `name` is the consumer's name ("producer" for the producer);
    `source` is informative only (a path) and never compared."""

    name: str
    config_hash: str
    weight_hash: str
    source: str = ""

    def matches(self, other: "ModelIdentity") -> bool:
        if self.config_hash != other.config_hash:
            return False
        return WILDCARD in (self.weight_hash, other.weight_hash) or self.weight_hash == other.weight_hash

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelIdentity":
        return cls(name=str(d["name"]), config_hash=str(d["config_hash"]), weight_hash=str(d["weight_hash"]),
                   source=str(d.get("source", "")))


def config_hash(arch) -> str:
    """sha256 of the architecture fields of a ModelArchConfig (or an HF config dict)."""
    from sgl_kvxfer.models.arch_config import ModelArchConfig

    if isinstance(arch, dict):
        arch = ModelArchConfig.from_hf_dict(arch)
    fields = {f.name: getattr(arch, f.name) for f in dataclasses.fields(arch)
              if f.name not in ("extra", "torch_dtype", "eos_token_ids", "bos_token_id")}
    blob = json.dumps(fields, sort_keys=True, default=list).encode()
    return hashlib.sha256(blob).hexdigest()


def _tensors_hash(path: str) -> str:
    """sha256 over (name, dtype, shape, bytes) of every tensor of one safetensors file."""
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    if key not in _FILE_CACHE:
        import torch
        from safetensors import safe_open

        h = hashlib.sha256()
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in sorted(f.keys()):
                t = f.get_tensor(name).contiguous()
                h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        _FILE_CACHE[key] = h.hexdigest()
    return _FILE_CACHE[key]


def adapter_files(adapter_dir: str) -> list[str]:
    """The files that define a peft LoRA adapter dir (config + weights)."""
    cfg = os.path.join(adapter_dir, "adapter_config.json")
    if not os.path.isfile(cfg):
        raise FileNotFoundError(f"not a LoRA adapter dir (no adapter_config.json): {adapter_dir}")
    weights = sorted(glob.glob(os.path.join(adapter_dir, "*.safetensors")))
    if not weights:
        raise FileNotFoundError(f"LoRA adapter dir has no *.safetensors: {adapter_dir}")
    return [cfg, *weights]


def weight_hash(model_dir: str, merge_lora: str | None = None) -> str:
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}: cannot name its weights")
    h = hashlib.sha256()
    for path in files:
        h.update(_tensors_hash(path).encode())
    if merge_lora:
        cfg_path, *weights = adapter_files(merge_lora)
        with open(cfg_path) as f:
            cfg = json.load(f)
        merge = {k: cfg.get(k) for k in ("r", "lora_alpha", "use_rslora")}
        h.update(b"+lora" + json.dumps(merge, sort_keys=True).encode())
        for path in weights:
            h.update(_tensors_hash(path).encode())
    return h.hexdigest()


def identify(model_dir: str, merge_lora: str | None = None, name: str = "") -> ModelIdentity:
    """ModelIdentity of a local HF-format dir (optionally + a LoRA adapter merged at load)."""
    from sgl_kvxfer.models.arch_config import ModelArchConfig

    source = model_dir if not merge_lora else f"{model_dir}+{merge_lora}"
    return ModelIdentity(name=name, config_hash=config_hash(ModelArchConfig.from_dir(model_dir)),
                         weight_hash=weight_hash(model_dir, merge_lora), source=source)


def as_identity(spec, name: str = "") -> ModelIdentity:
    """A ModelIdentity from: a ModelIdentity; a model dir; (model dir, adapter dir or None); a
    ModelArchConfig or HF config dict (config only: its weight hash is the wildcard)."""
    if isinstance(spec, ModelIdentity):
        return spec
    if isinstance(spec, (tuple, list)) and len(spec) == 2:
        return identify(str(spec[0]), spec[1], name)
    if isinstance(spec, (str, os.PathLike)):
        return identify(str(spec), None, name)
    return ModelIdentity(name=name, config_hash=config_hash(spec), weight_hash=WILDCARD, source="config")
