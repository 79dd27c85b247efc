"""Model registry: HF architecture name -> implementation class.

Llama, Mistral and Qwen2 share one implementation; their differences (qkv bias,
head_dim, rope variant) are all carried by `ModelArchConfig`.
"""
from __future__ import annotations

import torch

from sgl_kvxfer.models.arch_config import SUPPORTED_ARCHITECTURES, ModelArchConfig
from sgl_kvxfer.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[torch.nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}
assert set(MODEL_REGISTRY) == set(SUPPORTED_ARCHITECTURES)


def create_model(arch_config: ModelArchConfig, dtype: torch.dtype, device: str | torch.device) -> torch.nn.Module:
    """Instantiate with *uninitialized* params of `dtype` on `device`, in eval mode with
    requires_grad off. Built on the meta device first, so an 8B shape never touches
    CPU RAM and skips nn.Linear's init. Callers must load or init weights next."""
    if arch_config.architecture not in MODEL_REGISTRY:
        raise ValueError(f"Unsupported architecture {arch_config.architecture!r}; supported: {sorted(MODEL_REGISTRY)}")
    cls = MODEL_REGISTRY[arch_config.architecture]
    if arch_config.extra.get("fusedkv") is not None:  # config.json's fusedkv section: FusedKV / Lite
        from sgl_kvxfer.models.fusedkv_llama import FusedKVLlamaForCausalLM as cls
    with torch.device("meta"):
        model = cls(arch_config)
    device = torch.empty(0, device=device).device
    fresh: dict[int, torch.nn.Parameter] = {}  # id(meta param) -> real param; keeps ties
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in fresh:
                fresh[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=dtype, device=device), requires_grad=False)
            module._parameters[name] = fresh[id(p)]
    return model.eval()


__all__ = ["MODEL_REGISTRY", "ModelArchConfig", "create_model"]
