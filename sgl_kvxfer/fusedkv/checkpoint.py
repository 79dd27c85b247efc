"""Model directories in and out of the compact LM (model.py).

    load_base(dir)                  -> (config.json dict, {HF name: tensor}) of every *.safetensors
    load_lm(dir, device, dtype)     -> LM of a vanilla or FusedKV model dir (by its config.json)
    save_model_dir(lm, base, out)   writes a dir `launch_server --model-path` serves as is:

        out/model.safetensors   HF names, in the base checkpoint's dtype; layers that store no KV
                                have no k_proj / v_proj; FusedKV's kv_fusion tensors in float32
                                (models/fusedkv_math.py: names and shapes)
        out/config.json         the base config + the `fusedkv` section of lm.config
        out/tokenizer*.json ... copied from the base dir (COPY_FILES)
"""
from __future__ import annotations

import json
import os
import shutil

import torch

from sgl_kvxfer.fusedkv.model import LM, LMConfig
from sgl_kvxfer.models.fusedkv_math import CONFIG_KEY, check_fusion_tensors

COPY_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja",
              "special_tokens_map.json")


def load_base(model_dir: str) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    files = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    tensors: dict[str, torch.Tensor] = {}
    for n in files:
        tensors.update(load_file(os.path.join(model_dir, n)))
    return cfg, tensors


def checkpoint_dtype(model_dir: str) -> torch.dtype:
    """The dtype of the checkpoint's weight matrices (what a converted model is saved in), read
    from the safetensors headers without loading the tensors."""
    from safetensors import safe_open

    for n in sorted(os.listdir(model_dir)):
        if n.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, n), "pt") as f:
                for key in f.keys():
                    if key.endswith("proj.weight"):
                        return f.get_slice(key)[:1].dtype
    raise FileNotFoundError(f"no projection weights in {model_dir}'s safetensors")


def load_lm(model_dir: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> LM:
    """The compact LM of a model dir, vanilla or FusedKV (by its config.json)."""
    hf_config, tensors = load_base(model_dir)
    m = LM(LMConfig.from_hf_dict(hf_config))
    tensors = {k: v for k, v in tensors.items() if "rotary_emb" not in k}
    if m.lm_head is None:
        tensors.pop("lm_head.weight", None)
    m.load_state_dict(tensors, strict=True)
    return m.to(device=device, dtype=dtype).eval()


def model_tensors(lm: LM, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """lm's state dict as checkpoint tensors: fusion weights float32, the rest in `dtype`."""
    out = {}
    for name, t in lm.state_dict().items():
        t = t.detach().to("cpu")
        out[name] = (t.float() if ".kv_fusion." in name else t.to(dtype)).contiguous()
    return out


def save_model_dir(lm: LM, base_dir: str, out_dir: str, dtype: torch.dtype | None = None) -> str:
    """Write lm as a servable model dir (see the module docstring); returns out_dir."""
    from safetensors.torch import save_file

    c = lm.config
    if c.cross_layer is not None:
        raise ValueError(f"layout {c.cross_layer!r} is a training baseline: the engine serves vanilla, fusedkv, lite")
    with open(os.path.join(base_dir, "config.json")) as f:
        hf_config = {k: v for k, v in json.load(f).items() if k != CONFIG_KEY}
    if dtype is None:
        dtype = checkpoint_dtype(base_dir)
    tensors = model_tensors(lm, dtype)
    if c.fusedkv is not None:
        hf_config[CONFIG_KEY] = c.fusedkv.to_dict()
        check_fusion_tensors(c.fusedkv, tensors, c.num_kv_heads, c.head_dim)
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    for name in COPY_FILES:
        if os.path.isfile(os.path.join(base_dir, name)) and os.path.abspath(base_dir) != os.path.abspath(out_dir):
            shutil.copy(os.path.join(base_dir, name), os.path.join(out_dir, name))
    return out_dir
