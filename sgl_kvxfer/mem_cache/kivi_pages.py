"""KIVI-style int pages for one layer of a TieredKVPool int store: K per channel, V per token.

KIVI (Liu et al., ICML 2024) quantizes keys per channel (outlier channels get their own range)
and values per token. In the tiered pool's head-major pages of PAGE tokens that reads:

    k        uint8 [pages, Hkv, PAGE, D * bits / 8]   packed, channel c of a byte at bits * (c % per_byte)
    k_scale  fp16  [pages, Hkv, D]                    one scale and zero per channel, page and kv head,
    k_zero   fp16  [pages, Hkv, D]                    over the tokens the page holds
    v        uint8 [pages, Hkv, PAGE, D * bits / 8]
    v_scale  fp16  [pages, Hkv, PAGE, D / G]          per token, groups of G channels (as the codec)
    v_zero   fp16  [pages, Hkv, PAGE, D / G]

Asymmetric, like the codec: x ~= q * scale + zero, zero = min rounded down to fp16, scale =
(max - min) / QMAX rounded up to fp16, q = floor((x - zero) / scale + 0.5), QMAX = 2**bits - 1.

NOTE: a page's key scales cover the tokens of ONE write. The tiered allocator hands int ids out
on fresh pages, one run per alloc_tier call, and a page's unused tail stays unused until the page
is free (tiered_allocator.py), so every page is written once. Codes are therefore not
`relocatable` bit for bit into another page: TieredKVPool.move requantizes instead, and PD
transfer (stored codes on the wire) refuses this format.
"""
from __future__ import annotations

import torch

_SCALE_DTYPE = torch.float16


def _round_up_fp16(v: torch.Tensor) -> torch.Tensor:
    """Smallest fp16 >= v (v fp32, >= 0)."""
    h = v.to(torch.float16)
    bumped = (h.view(torch.int16) + 1).view(torch.float16)
    return torch.where(h.float() < v, bumped, h)


def _round_down_fp16(v: torch.Tensor) -> torch.Tensor:
    """Largest fp16 <= v (v fp32, any sign)."""
    h = v.to(torch.float16)
    bits = h.view(torch.int16)
    down = torch.where(h > 0, bits - 1, torch.where(h < 0, bits + 1, torch.full_like(bits, -32767)))
    return torch.where(h.float() > v, down.view(torch.float16), h)


def scale_zero(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 (scale, zero) covering [lo, hi] (fp32) at `bits`."""
    zero = _round_down_fp16(lo)
    qmax = torch.full_like(lo, float((1 << bits) - 1))
    return _round_up_fp16((hi - zero.float()) / qmax), zero


def encode(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """x [..., D] fp32 with broadcastable fp16 scale / zero -> packed uint8 [..., D * bits / 8]."""
    s = scale.float()
    q = torch.floor((x - zero.float()) / torch.where(s > 0, s, torch.ones_like(s)) + 0.5)
    q = torch.where(s > 0, q.clamp_(0, (1 << bits) - 1), torch.zeros_like(q)).to(torch.uint8)
    per = 8 // bits
    if per == 1:
        return q.contiguous()
    out = q[..., 0::per].clone()
    for i in range(1, per):
        out |= q[..., i::per] << (bits * i)
    return out


def decode(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed uint8 [..., W] -> float32 codes [..., W * 8 / bits]."""
    per = 8 // bits
    if per == 1:
        return q.float()
    mask = (1 << bits) - 1
    parts = [(q >> (bits * i)) & mask for i in range(per)]
    return torch.stack(parts, dim=-1).reshape(*q.shape[:-1], q.shape[-1] * per).float()


def quantize_per_token(x: torch.Tensor, bits: int, group_size: int):
    """x [..., D] -> (packed q, scale [..., D/G], zero [..., D/G]): groups of G channels per token."""
    d = x.shape[-1]
    xg = x.float().reshape(*x.shape[:-1], d // group_size, group_size)
    scale, zero = scale_zero(xg.amin(-1), xg.amax(-1), bits)
    q = encode(xg, scale[..., None], zero[..., None], bits)
    return q.reshape(*x.shape[:-1], d * bits // 8), scale, zero


def dequantize_per_token(q, scale, zero, bits: int, group_size: int, dtype) -> torch.Tensor:
    vals = decode(q, bits)
    d = vals.shape[-1]
    vg = vals.reshape(*vals.shape[:-1], d // group_size, group_size)
    return (vg * scale.float()[..., None] + zero.float()[..., None]).reshape(*vals.shape).to(dtype)


class ChannelKeyIntPages:
    """One layer's int store in the KIVI format (module docstring). Same interface as
    kernels/paged_layout.TierPages: write / read / codes at (page, offset) index tensors [n]."""

    relocatable = False  # see the module NOTE

    def __init__(self, bits: int, pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 group_size: int, device: str):
        if head_dim * bits % 8 or head_dim % group_size:
            raise ValueError(f"head_dim {head_dim} must pack at {bits} bits and be a multiple of {group_size}")
        self.bits, self.group_size = bits, group_size
        width = head_dim * bits // 8
        self.k = torch.zeros((pages, num_kv_heads, page_size, width), dtype=torch.uint8, device=device)
        self.v = torch.zeros_like(self.k)
        self.k_scale, self.k_zero = (torch.zeros((pages, num_kv_heads, head_dim), dtype=_SCALE_DTYPE, device=device)
                                     for _ in range(2))
        self.v_scale, self.v_zero = (torch.zeros((pages, num_kv_heads, page_size, head_dim // group_size),
                                                 dtype=_SCALE_DTYPE, device=device) for _ in range(2))

    def tensors(self) -> tuple:
        return self.k, self.v, self.k_scale, self.k_zero, self.v_scale, self.v_zero

    def write(self, page: torch.Tensor, off: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Tokens (page, off) [n] get k, v [n, Hkv, D]. Key scales: min / max per channel over the
        tokens of each page in this write (a page is written once: module NOTE)."""
        kf = k.float()
        uniq, inv = page.unique(return_inverse=True)
        idx = inv[:, None, None].expand_as(kf)
        shape = (uniq.numel(), *kf.shape[1:])
        lo = torch.full(shape, float("inf"), device=kf.device).scatter_reduce(0, idx, kf, "amin")
        hi = torch.full(shape, float("-inf"), device=kf.device).scatter_reduce(0, idx, kf, "amax")
        scale, zero = scale_zero(lo, hi, self.bits)
        self.k_scale[uniq], self.k_zero[uniq] = scale, zero
        self.k[page, :, off] = encode(kf, scale[inv], zero[inv], self.bits)
        self.v[page, :, off], self.v_scale[page, :, off], self.v_zero[page, :, off] = \
            quantize_per_token(v, self.bits, self.group_size)

    def read(self, page: torch.Tensor, off: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        v = dequantize_per_token(self.v[page, :, off], self.v_scale[page, :, off], self.v_zero[page, :, off],
                                 self.bits, self.group_size, dtype)
        return self.read_keys(page, off, dtype), v

    def read_keys(self, page: torch.Tensor, off: torch.Tensor, dtype) -> torch.Tensor:
        k = decode(self.k[page, :, off], self.bits) * self.k_scale[page].float() + self.k_zero[page].float()
        return k.to(dtype)

    def codes(self, page, off) -> tuple:
        raise NotImplementedError("KIVI pages have per-page key scales: their codes do not travel bit for bit")

    def put_codes(self, page, off, parts) -> None:
        raise NotImplementedError("KIVI pages have per-page key scales: their codes do not travel bit for bit")
