"""Tiny random Llama model dirs for SCD tests (imported by conftest and tests)."""
import json
import os

import torch

TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "max_position_embeddings": 2048, "tie_word_embeddings": True,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
}


def tiny_state(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    sd = {"model.embed_tokens.weight": torch.randn(cfg["vocab_size"], h, generator=g) * 0.5,
          "model.norm.weight": torch.ones(h)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                  "self_attn.o_proj": (h, q), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h),
                  "mlp.down_proj": (h, i)}
        for name, shape in shapes.items():
            sd[p + name + ".weight"] = torch.randn(*shape, generator=g) / shape[1] ** 0.5
        sd[p + "input_layernorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(h)
    return sd


def write_model(path, cfg: dict, sd: dict) -> str:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(path, "model.safetensors"))
    return str(path)


def perturbed(sd: dict, scale: float, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: (v + scale * v.std() * torch.randn(v.shape, generator=g) if v.dim() == 2 and "embed" not in k else v)
            for k, v in sd.items()}


