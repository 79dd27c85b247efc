"""Tiny dummy-weights Llama configs and model dirs, shared by the engine, layers and scheduler
tests (the `tiny_dir` fixture in test/conftest.py writes a test module's TINY)."""
from __future__ import annotations

import json
import os

# 2 layers, 4 q / 2 kv heads, head_dim 32, fp16: small enough for the Triton interpreter on CPU
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "vocab_size": 256,
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "max_position_embeddings": 1024, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "float16",
}


def tiny_llama(**overrides) -> dict:
    """TINY_LLAMA with some fields changed (unknown names are an error, not a silent new key)."""
    unknown = set(overrides) - set(TINY_LLAMA)
    assert not unknown, f"not a TINY_LLAMA field: {sorted(unknown)}"
    return {**TINY_LLAMA, **overrides}


def write_tiny_model(out_dir: str, config: dict) -> str:
    """config.json plus a word-level tokenizer of the config's vocab (`--load-format dummy`: no
    weights, no embedded-model conversion); returns out_dir."""
    from sgl_kvxfer.models.presets import write_dummy_tokenizer

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return write_dummy_tokenizer(out_dir, config["vocab_size"])
