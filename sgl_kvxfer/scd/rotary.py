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
        self._memo = None  # (positions, -, cos, sin) of the last lookup (prime)

    @classmethod
    def from_arch(cls, arch) -> "KeyRotary":
        return cls(arch.head_dim, arch.rope_theta, arch.rope_scaling, arch.max_position_embeddings)

    def _cos_sin(self, positions: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
        memo = self._memo
        if memo is not None and memo[0] is positions and memo[2].device == torch.device(device):
            return memo[2], memo[3]
        return self.prime(positions, device)

    def prime(self, positions: torch.Tensor, device=None, num_positions: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin [T, 1, D/2] of `positions` (float32), kept for later calls with this same
        tensor object: a segment's layers share one table lookup. `num_positions`, a host-side
        bound (every position < it), spares the lookup's device sync (positions.max()).
        NOTE: keyed by identity: a positions tensor must not be changed in place once primed."""
        p = positions.to(device=positions.device if device is None else device, dtype=torch.long).reshape(-1)
        cos, sin = self.rotary.cos_sin(p, torch.float32, num_positions)
        self._memo = (positions, None, cos, sin)
        return cos, sin

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
