"""RoPE and its inverse for keys, on the engine's own cos/sin tables (layers/rope.py).

The engine stores keys rotated: k = R(theta_p) k_content * a, with `a` the variant's attention
scaling folded into cos/sin (1 except YaRN). SCD encodes keys in the content frame:

    derope(k) = R(-theta_p) k / a        rope(x) = R(theta_p) x * a

Both run in float32 on the engine's float32 tables, so rope(derope(k)) == k up to float32
rounding and rope(x) for float32 x is bit-identical to the engine's `apply_rope` in float32.
"""
from __future__ import annotations

import torch

from sgl_kvxfer.layers.rope import RotaryEmbedding, apply_rope


class KeyRotary:
    def __init__(self, head_dim: int, rope_theta: float, rope_scaling: dict | None, max_position_embeddings: int):
        self.rotary = RotaryEmbedding(head_dim, rope_theta, rope_scaling, max_position_embeddings)

    @classmethod
    def from_arch(cls, arch) -> "KeyRotary":
        return cls(arch.head_dim, arch.rope_theta, arch.rope_scaling, arch.max_position_embeddings)

    def _cos_sin(self, positions: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
        positions = positions.to(device=device, dtype=torch.long).reshape(-1)
        return self.rotary.cos_sin(positions, torch.float32)  # [T, 1, D/2] each

    def rope(self, x: torch.Tensor, positions: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [T, H, D] content-frame keys -> post-RoPE keys [T, H, D] (`out_dtype`, default x's)."""
        cos, sin = self._cos_sin(positions, x.device)
        return apply_rope(x.float(), cos, sin).to(out_dtype or x.dtype)

    def derope(self, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """k [T, H, D] post-RoPE keys -> content-frame keys [T, H, D] float32."""
        cos, sin = self._cos_sin(positions, k.device)
        a2 = self.rotary.attention_scaling ** 2
        half = k.shape[-1] // 2
        k = k.float()
        k1, k2 = k[..., :half], k[..., half:]
        out = torch.cat([k1 * cos + k2 * sin, k2 * cos - k1 * sin], dim=-1)
        return out if a2 == 1.0 else out / a2
