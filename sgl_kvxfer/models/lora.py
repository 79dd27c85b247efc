"""Merge a peft LoRA adapter into base weights at load time (`--merge-lora DIR`).

A peft adapter dir holds `adapter_config.json` and `adapter_model.safetensors` with, per
adapted linear `<module>`: `base_model.model.<module>.lora_A.weight` [r, in] and
`...lora_B.weight` [out, r]. Merging is W' = W + s * B @ A with s = lora_alpha / r
(lora_alpha / sqrt(r) under use_rslora), computed in float32 before the cast to the model dtype:
the merged model then runs at base speed with no adapter code on the serving path.
Unsupported adapter features (DoRA, per-module alpha patterns, modules_to_save, fan_in_fan_out)
are refused with an error rather than merged wrongly.
"""
from __future__ import annotations

import glob
import json
import math
import os
from typing import Iterable, Iterator

import torch

_PREFIX = "base_model.model."


def load_lora_deltas(adapter_dir: str) -> dict[str, torch.Tensor]:
    """HF weight name (e.g. model.layers.0.self_attn.q_proj.weight) -> float32 delta s * B @ A."""
    cfg_path = os.path.join(adapter_dir, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"--merge-lora: no adapter_config.json in {adapter_dir}")
    with open(cfg_path) as f:
        cfg = json.load(f)
    for key in ("use_dora", "fan_in_fan_out"):
        if cfg.get(key):
            raise ValueError(f"--merge-lora: adapters with {key}=true are not supported ({adapter_dir})")
    if cfg.get("alpha_pattern") or cfg.get("modules_to_save"):
        raise ValueError(f"--merge-lora: alpha_pattern / modules_to_save are not supported ({adapter_dir})")
    files = sorted(glob.glob(os.path.join(adapter_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"--merge-lora: no *.safetensors in {adapter_dir}")
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        tensors.update(load_file(path))
    alpha = float(cfg["lora_alpha"])
    deltas = {}
    for name, a in tensors.items():
        if not name.endswith(".lora_A.weight"):
            continue
        b = tensors.get(name.replace(".lora_A.", ".lora_B."))
        if b is None:
            raise ValueError(f"--merge-lora: {name} has no lora_B partner")
        r = a.shape[0]
        scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        target = name[len(_PREFIX):] if name.startswith(_PREFIX) else name
        target = target.replace(".lora_A.weight", ".weight")
        deltas[target] = scale * (b.float() @ a.float())
    if not deltas:
        raise ValueError(f"--merge-lora: {adapter_dir} holds no lora_A / lora_B weights")
    return deltas


def merged_weights(weights: Iterable[tuple[str, torch.Tensor]], adapter_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the base checkpoint's tensors with the adapter's deltas added (float32 add). Raises
    if an adapted module is missing from the checkpoint (adapter of another architecture)."""
    deltas = load_lora_deltas(adapter_dir)
    for name, t in weights:
        delta = deltas.pop(name, None)
        if delta is not None:
            if tuple(delta.shape) != tuple(t.shape):
                raise ValueError(f"--merge-lora: delta for {name} is {tuple(delta.shape)}, weight is {tuple(t.shape)}")
            t = (t.float() + delta).to(t.dtype)
        yield name, t
    if deltas:
        raise ValueError(f"--merge-lora: adapter modules not in the checkpoint: {sorted(deltas)[:4]}")
