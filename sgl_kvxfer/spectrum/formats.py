"""Per-layer storage formats of the int stores: what "int8" and "int4" mean in each layer.

A token's tier is still one id (the store it sits in); `StoreFormats` says, for each int store and
each layer, how that store encodes the token's K and V:

    IntFormat(bits, key_axis)
      bits      8 or 4 (the codec, kernels/tier_codec.py), or 2 (channel key axis only)
      key_axis  "token":   K like V, per token: one fp16 scale and zero per group of G channels
                "channel": K per channel over one int page (KIVI): one fp16 scale and zero per
                           channel, per page of PAGE tokens, per kv head; V stays per token

    StoreFormats.int8[layer], StoreFormats.int4[layer] -> IntFormat

`StoreFormats.uniform(L)` (int8 store (8, token), int4 store (4, token) in every layer) is the
codec's layout, the only one the Triton kernels and PD transfer read; any other runs on the torch
attention backend. Two users change it: per-layer budgets (spectrum/layer_budget.py: the int4
store at 8 bits in the layers a profile found sensitive) and the KIVI baseline (policies/kivi.py).

Bytes of one head vector (one of K or V, one token, one layer, one kv head), scales fp16:

    token axis, K and V   ceil(D * bits / 8) + 2 * ceil(D / G) * 2
    channel axis, K       ceil(D * bits / 8) + 2 * D * 2 / PAGE        (page scales, amortized)
    channel axis, V       as the token axis
"""
from __future__ import annotations

from dataclasses import dataclass

KEY_AXES = ("token", "channel")
TOKEN_AXIS_BITS = (8, 4)
CHANNEL_AXIS_BITS = (8, 4, 2)


@dataclass(frozen=True)
class IntFormat:
    bits: int
    key_axis: str = "token"

    def __post_init__(self):
        if self.key_axis not in KEY_AXES:
            raise ValueError(f"key_axis must be one of {KEY_AXES}, got {self.key_axis!r}")
        allowed = TOKEN_AXIS_BITS if self.key_axis == "token" else CHANNEL_AXIS_BITS
        if self.bits not in allowed:
            raise ValueError(f"{self.key_axis}-axis int formats take bits in {allowed}, got {self.bits}")

    def head_bytes(self, head_dim: int, group_size: int, page_size: int, scale_bytes: int = 2) -> tuple[float, float]:
        """(K bytes, V bytes) of one head vector in this format (see the module table)."""
        data = (head_dim * self.bits + 7) // 8
        per_token = data + 2 * (-(-head_dim // group_size)) * scale_bytes
        if self.key_axis == "token":
            return per_token, per_token
        return data + 2 * head_dim * scale_bytes / page_size, per_token

    def label(self) -> str:
        return f"int{self.bits}" + ("c" if self.key_axis == "channel" else "")


TOKEN_INT8, TOKEN_INT4 = IntFormat(8), IntFormat(4)


@dataclass(frozen=True)
class StoreFormats:
    """Formats of the int8 and int4 stores, one entry per layer."""
    int8: tuple[IntFormat, ...]
    int4: tuple[IntFormat, ...]

    def __post_init__(self):
        if len(self.int8) != len(self.int4) or not self.int8:
            raise ValueError(f"one format per layer in each store, got {len(self.int8)} and {len(self.int4)}")

    @classmethod
    def uniform(cls, num_layers: int) -> "StoreFormats":
        return cls((TOKEN_INT8,) * num_layers, (TOKEN_INT4,) * num_layers)

    @classmethod
    def with_int4(cls, formats) -> "StoreFormats":
        """Codec int8 store, the given per-layer int4 store formats."""
        formats = tuple(formats)
        return cls((TOKEN_INT8,) * len(formats), formats)

    @property
    def num_layers(self) -> int:
        return len(self.int8)

    @property
    def is_uniform(self) -> bool:
        return all(f == TOKEN_INT8 for f in self.int8) and all(f == TOKEN_INT4 for f in self.int4)

    def of(self, tier: int, layer: int) -> IntFormat:
        """Format of int store `tier` (1 = int8 store, 2 = int4 store) in `layer`."""
        return (self.int8, self.int4)[tier - 1][layer]

    def token_bytes(self, tier: int, num_kv_heads: int, head_dim: int, group_size: int, page_size: int,
                    scale_bytes: int = 2) -> float:
        """Bytes one token of int store `tier` takes, all layers, K and V."""
        total = 0.0
        for layer in range(self.num_layers):
            k, v = self.of(tier, layer).head_bytes(head_dim, group_size, page_size, scale_bytes)
            total += k + v
        return num_kv_heads * total

    def describe(self) -> dict:
        """JSON-friendly summary: per store, the label of each layer's format."""
        return {"int8": [f.label() for f in self.int8], "int4": [f.label() for f in self.int4]}
