"""Build a converted FusedKV model dir from a base Llama checkpoint + the retrofit's small file.

    python benchmarks/fusedkv/build_model.py --weights PATH/fusedkv_retrofit_weights_full_cuda.safetensors \
        --out ~/.cache/sgl_kvxfer/models/smollm2-135m-fusedkv [--base DIR] [--check-ppl]

The retrofit (retrofit.py, on the GPU) returns one safetensors file (< 16 MiB) instead of the
model: the fusion weights, the tuned RMSNorm weights and the LoRA factors, with metadata
(fusedkv config, LoRA scale, a fingerprint of the base weights). This rebuilds the full model:

    base model.safetensors (HF names, e.g. the embedded SmolLM2, converted from its GGUF)
      + W += scale * B @ A                     for each LoRA pair '<path>.lora_A' / '.lora_B'
      + norm weights replaced                  '<...>norm.weight' tensors of the file
      - k_proj / v_proj of reconstruction layers
      + model.layers.{i}.self_attn.kv_fusion.* (FusedKV; fusedkv_math.fusion_param_names)
    config.json = base config + its "fusedkv" section; tokenizer / generation files copied.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

from sgl_kvxfer.models.fusedkv_math import CONFIG_KEY, FusedKVConfig, check_fusion_tensors  # noqa: E402

COPY_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja",
              "special_tokens_map.json")
FINGERPRINT_TENSORS = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight")


def fingerprint(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over a few base tensors' bytes: the retrofit's base must be the one rebuilt here."""
    h = hashlib.sha256()
    for name in FINGERPRINT_TENSORS:
        if name in tensors:
            h.update(name.encode())
            h.update(tensors[name].detach().float().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def load_base(base_dir: str) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    with open(os.path.join(base_dir, "config.json")) as f:
        cfg = json.load(f)
    files = sorted(n for n in os.listdir(base_dir) if n.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {base_dir}")
    tensors: dict[str, torch.Tensor] = {}
    for n in files:
        tensors.update(load_file(os.path.join(base_dir, n)))
    return cfg, tensors


def convert_tensors(hf_config: dict, base: dict[str, torch.Tensor], small: dict[str, torch.Tensor],
                    fusedkv: FusedKVConfig, lora_scale: float) -> dict[str, torch.Tensor]:
    """The converted checkpoint's tensors (base left untouched)."""
    from model import merge_lora_into

    out = dict(base)
    lora = {k: v for k, v in small.items() if k.endswith((".lora_A", ".lora_B"))}
    merge_lora_into(out, lora, lora_scale)
    for k, v in small.items():
        if k.endswith("norm.weight"):
            if k not in out:
                raise KeyError(f"norm {k} not in the base checkpoint")
            out[k] = v.to(out[k].dtype)
        elif ".kv_fusion." in k:
            out[k] = v.float()
    for i in fusedkv.reconstruction_layers:
        for proj in ("k_proj", "v_proj"):
            for suffix in ("weight", "bias"):
                out.pop(f"model.layers.{i}.self_attn.{proj}.{suffix}", None)
    kvh = int(hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"])
    hd = int(hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"])
    check_fusion_tensors(fusedkv, out, kvh, hd)
    return out


def build_converted(weights_file: str, out_dir: str, base_dir: str | None = None, check_fingerprint: bool = True) -> str:
    """Write the converted model dir; returns out_dir."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    if base_dir is None:
        from sgl_kvxfer.models.loader import resolve_model_path

        base_dir = resolve_model_path(None)
    with safe_open(weights_file, "pt") as f:
        meta = f.metadata() or {}
        small = {k: f.get_tensor(k) for k in f.keys()}
    hf_config, base = load_base(base_dir)
    if check_fingerprint and meta.get("base_fingerprint") and meta["base_fingerprint"] != fingerprint(base):
        raise ValueError(f"{weights_file} was tuned on other base weights than {base_dir} (fingerprint differs)")
    hf_config = {**hf_config, CONFIG_KEY: json.loads(meta[CONFIG_KEY])}
    fusedkv = FusedKVConfig.from_hf_dict(hf_config)
    tensors = convert_tensors(hf_config, base, small, fusedkv, float(meta.get("lora_scale", 0.0)))
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    for name in COPY_FILES:
        if os.path.isfile(os.path.join(base_dir, name)):
            shutil.copy(os.path.join(base_dir, name), os.path.join(out_dir, name))
    return out_dir


def load_lm(model_dir: str, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """The compact LM (model.py) of a model dir, vanilla or FusedKV (by its config.json)."""
    from model import LM, LMConfig

    hf_config, tensors = load_base(model_dir)
    m = LM(LMConfig.from_hf_dict(hf_config))
    tensors = {k: v for k, v in tensors.items() if "rotary_emb" not in k}
    if m.lm_head is None:
        tensors.pop("lm_head.weight", None)
    m.load_state_dict(tensors, strict=True)
    return m.to(device=device, dtype=dtype).eval()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", required=True, help="fusedkv_retrofit_weights*.safetensors from retrofit.py")
    ap.add_argument("--out", required=True)
    ap.add_argument("--base", default=None, help="base model dir (default: the embedded SmolLM2)")
    ap.add_argument("--check-ppl", action="store_true", help="PPL of base and converted on a few eval windows (CPU)")
    ap.add_argument("--data-dir", default=None)
    a = ap.parse_args()
    out = build_converted(a.weights, a.out, a.base)
    print(f"wrote {out}")
    if a.check_ppl:
        from data import DEFAULT_DIR, load_split, mixed_chunks
        from retrofit import perplexity

        from sgl_kvxfer.models.loader import resolve_model_path

        windows = mixed_chunks(load_split(a.data_dir or DEFAULT_DIR, "eval"), 256, 8)
        for tag, d in (("base", a.base or resolve_model_path(None)), ("converted", out)):
            print(f"{tag}: PPL {perplexity(load_lm(d), windows, 4, 'cpu', None):.3f} on {windows.numel()} tokens")


if __name__ == "__main__":
    main()
