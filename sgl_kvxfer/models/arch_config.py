"""Model architecture description parsed from an HF `config.json` dict.

Accepts both transformers-4 layout (`rope_theta` + `rope_scaling` at top level,
`torch_dtype`) and transformers-5 layout (`rope_parameters` holding `rope_theta`
and the scaling keys, `dtype`). `rope_scaling` is normalized to a dict carrying
`rope_type` (never the legacy `type` key), or None for plain RoPE.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


def _eos_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _split_rope(d: dict) -> tuple[float, dict | None]:
    """Returns (rope_theta, rope_scaling) from either config layout."""
    params = dict(d.get("rope_parameters") or {})
    legacy = dict(d.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None) or d.get("rope_theta") or 10000.0
    scaling = {**legacy, **params}
    scaling.pop("rope_theta", None)
    rope_type = scaling.pop("type", None)
    rope_type = scaling.get("rope_type", rope_type) or "default"
    if rope_type == "default":
        return float(theta), None
    scaling["rope_type"] = rope_type
    return float(theta), scaling


@dataclass(frozen=True)
class ModelArchConfig:
    """Shapes and numerics of a decoder-only Llama-family model.

    Invariants: num_attention_heads % num_key_value_heads == 0 (GQA groups);
    q projects to num_attention_heads * head_dim, which need not equal hidden_size.
    attention_bias: bias on q/k/v projections. o_proj_bias: bias on o_proj
    (Llama's `attention_bias` sets both; Qwen2 has qkv bias only).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architectures: tuple[str, ...] = ("LlamaForCausalLM",)
    model_type: str = "llama"
    torch_dtype: str | None = None
    # Mistral/Qwen2 sliding window; recorded but not enforced (full attention is
    # exact while sequences stay shorter than the window).
    sliding_window: int | None = None
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def architecture(self) -> str:
        return self.architectures[0]

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelArchConfig":
        model_type = d.get("model_type", "llama")
        archs = tuple(d.get("architectures") or ())
        if not archs and model_type in _MODEL_TYPE_TO_ARCH:
            archs = (_MODEL_TYPE_TO_ARCH[model_type],)
        if not archs or archs[0] not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"Unsupported architecture {list(archs) or model_type!r}; "
                f"sgl_kvxfer supports {list(SUPPORTED_ARCHITECTURES)} (SmolLM2 is Llama)."
            )
        hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
        theta, scaling = _split_rope(d)
        is_qwen2 = model_type == "qwen2" or archs[0] == "Qwen2ForCausalLM"
        attn_bias = True if is_qwen2 else bool(d.get("attention_bias", False))
        sliding = d.get("sliding_window")
        if is_qwen2 and not d.get("use_sliding_window", False):
            sliding = None
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=attn_bias,
            o_proj_bias=attn_bias and not is_qwen2,
            mlp_bias=bool(d.get("mlp_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_eos_tuple(d.get("eos_token_id")),
            architectures=archs,
            model_type=model_type,
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            sliding_window=int(sliding) if sliding else None,
            extra=dict(d),
        )

    @classmethod
    def from_dir(cls, model_dir: str) -> "ModelArchConfig":
        """Parse `model_dir/config.json`; merges eos ids from generation_config.json."""
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = cls.from_hf_dict(json.load(f))
        gen_path = os.path.join(model_dir, "generation_config.json")
        if os.path.isfile(gen_path):
            with open(gen_path) as f:
                gen_eos = _eos_tuple(json.load(f).get("eos_token_id"))
            merged = cfg.eos_token_ids + tuple(e for e in gen_eos if e not in cfg.eos_token_ids)
            if merged != cfg.eos_token_ids:
                import dataclasses

                cfg = dataclasses.replace(cfg, eos_token_ids=merged)
        return cfg
