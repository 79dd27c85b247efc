"""Rotary position embedding: inverse-frequency variants and a lazily grown cos/sin cache.

Variants (the `rope_type` of `ModelArchConfig.rope_scaling`), numerically matching
transformers' `ROPE_INIT_FUNCTIONS`:
    default  theta^(-2i/d)
    linear   default / factor
    dynamic  NTK-aware base rescale. HF recomputes it whenever a sequence grows past
             max_position_embeddings; a KV cache of already-rotated keys cannot follow
             that, so we fix it statically at `dynamic_seq_len` (default
             max_position_embeddings, which is exactly HF's value for every sequence
             within the original context).
    llama3   wavelength-banded interpolation (Llama 3.1+)
    yarn     NTK-by-parts ramp plus an attention factor folded into cos/sin (as HF does)

Rotation is neox/half style like HF Llama: x = [x1 | x2] (halves of head_dim),
out = [x1*cos - x2*sin | x2*cos + x1*sin].
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from sgl_kvxfer.kernels.reference import apply_rope  # noqa: F401  (the rotation; the kernels' reference)

_InvFreqFn = Callable[[int, float, dict, int], "tuple[torch.Tensor, float]"]


def _base_inv_freq(dim: int, base: float) -> torch.Tensor:
    """[dim/2] float32; int64 arange then float, as HF does, for bit-identical values.
    Always on CPU (even under a `torch.device("meta")` context); moved at cache build."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))


def _default(dim, base, scaling, max_pos):
    return _base_inv_freq(dim, base), 1.0


def _linear(dim, base, scaling, max_pos):
    return _base_inv_freq(dim, base) / scaling["factor"], 1.0


def _dynamic(dim, base, scaling, max_pos):
    factor = scaling["factor"]
    seq_len = max(int(scaling.get("dynamic_seq_len") or max_pos), max_pos)
    base = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    return _base_inv_freq(dim, base), 1.0


def _llama3(dim, base, scaling, max_pos):
    inv_freq = _base_inv_freq(dim, base)
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    # wavelen < high_wavelen: keep; wavelen > low_wavelen: divide by factor; between: blend.
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim, base, scaling, max_pos):
    orig = scaling.get("original_max_position_embeddings") or max_pos
    factor = scaling.get("factor") or max_pos / orig
    attn = scaling.get("attention_factor")
    if attn is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attn = _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all) if (m and m_all) else _yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def corr_dim(rot):
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    lo, hi = corr_dim(beta_fast), corr_dim(beta_slow)
    if scaling.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - lo) / (hi - lo), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrap, interp = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1 => extrapolate (high frequency), 0 => interpolate
    return interp * (1 - keep) + extrap * keep, float(attn)


ROPE_VARIANTS: dict[str, _InvFreqFn] = {
    "default": _default,
    "linear": _linear,
    "dynamic": _dynamic,
    "llama3": _llama3,
    "yarn": _yarn,
}


def compute_inv_freq(
    head_dim: int, rope_theta: float, rope_scaling: dict | None, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [head_dim/2] float32, attention_scaling applied to cos/sin)."""
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    if rope_type not in ROPE_VARIANTS:
        raise ValueError(f"Unsupported rope_type {rope_type!r}; supported: {sorted(ROPE_VARIANTS)}")
    return ROPE_VARIANTS[rope_type](head_dim, rope_theta, rope_scaling or {}, max_position_embeddings)


class RotaryEmbedding:
    """cos/sin cache [P, head_dim/2] (float32) indexed by absolute position.

    Grows on demand (to max(needed, 2x current, 4096) rows) so long-context
    configs (e.g. 131072 positions) do not pay for the full table up front.
    Not thread-safe: growth replaces the cache tensors.
    """

    def __init__(self, head_dim: int, rope_theta: float, rope_scaling: dict | None, max_position_embeddings: int):
        self.head_dim = head_dim
        inv_freq, self.attention_scaling = compute_inv_freq(head_dim, rope_theta, rope_scaling, max_position_embeddings)
        self.inv_freq = inv_freq
        self._cos = self._sin = None  # [P, D/2] on the device of last use

    def _build(self, n: int, device) -> None:
        pos = torch.arange(n, dtype=torch.float32, device=device)
        freqs = pos[:, None] * self.inv_freq.to(device)[None, :]
        self._cos = freqs.cos() * self.attention_scaling
        self._sin = freqs.sin() * self.attention_scaling

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype,
                num_positions: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions LongTensor[T] -> (cos, sin) each [T, 1, D/2] in `dtype` (broadcast over heads).

        num_positions: a host-side bound (every position < it), e.g. max(seq_lens_cpu); without
        it the bound is positions.max(), a device sync (not allowed inside CUDA-graph capture)."""
        if num_positions is None:
            num_positions = int(positions.max().item()) + 1 if positions.numel() else 1
        # NOTE: growth replaces the cache tensors; a captured CUDA graph keeps reading the old
        # ones, so the graph runner ensures the whole context before it captures.
        self.ensure(num_positions, positions.device)
        cos = self._cos.index_select(0, positions).to(dtype)
        sin = self._sin.index_select(0, positions).to(dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def ensure(self, n: int, device) -> None:
        """Make the cache cover positions [0, n) on `device`."""
        device = torch.empty(0, device=device).device  # normalize "cuda" -> cuda:0
        have = 0 if self._cos is None else self._cos.shape[0]
        if have >= n and self._cos.device == device:
            return
        self._build(max(n, 2 * have, 4096), device)
