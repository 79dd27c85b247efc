"""The SCD segment kind: a token range's semantic codes as bytes on the wire, and back.

An SCD producer ships codes instead of KV (disagg/scd_prefill.py; docs/pd_disaggregation.md,
"SCD over PD"). A segment covers prompt positions [start, end); its payload holds the code
fields in the manifest's wire order (`ScdManifest.code_layout`), each token-major:

    payload = field 0 [n, *shape_0] | field 1 [n, *shape_1] | ...      (the codes' dtype)
    fields  = layer by layer: a Reuse layer -> k [Hkv, r_k], v [Hkv, r_v]; a Patch layer -> h [r_h]

With a quantised wire dtype (manifest dtype "int8" / "int4", mem_cache/scd_quant.py) a field's block is
its integers [n, ceil(elems * bits / 8)] then its n bfloat16 scales; unpacking dequantises to
float32 (a copy, not a view).

Segments are checksummed in blocks and acked exactly like KV segments (kv_payload.py); only
their bytes differ, and a KVSegment with `codes=True` says which kind it carries. Both sides
must agree on the layout, which the artifacts' manifest id guarantees.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_kvxfer.mem_cache.scd_quant import field_bytes, pack_field, unpack_field

Field = tuple[int, str, tuple[int, ...]]  # (layer, "k" | "v" | "h", per-token shape)


@dataclass(frozen=True)
class CodeLayout:
    fields: tuple[Field, ...]
    dtype: torch.dtype
    bits: int = 0  # a quantised wire dtype's bits per number (0: the codes travel in `dtype`)

    @classmethod
    def from_manifest(cls, manifest, level: tuple[int, int] | None = None) -> "CodeLayout":
        """The layout at a nested rank level (default the top)."""
        return cls(tuple((int(l), k, tuple(s)) for l, k, s in manifest.code_layout(level)), manifest.code_dtype,
                   manifest.wire_bits)

    @property
    def itemsize(self) -> int:
        return torch.finfo(self.dtype).bits // 8

    def field_elems(self, shape: tuple[int, ...]) -> int:
        n = 1
        for d in shape:
            n *= d
        return n

    def field_bytes(self, shape: tuple[int, ...]) -> int:
        """Wire bytes of one token's field."""
        n = self.field_elems(shape)
        return field_bytes(n, self.bits) if self.bits else n * self.itemsize

    @property
    def bytes_per_token(self) -> int:
        return sum(self.field_bytes(s) for _, _, s in self.fields)

    def nbytes(self, tokens: int) -> int:
        return self.bytes_per_token * tokens


def pack_codes(layout: CodeLayout, codes: dict[tuple[int, str], torch.Tensor], out: torch.Tensor) -> int:
    """Write the codes of n tokens ({(layer, kind): [n, *shape]}, any device) into `out`
    (uint8, >= layout.nbytes(n)); returns the bytes written.

    NOTE: copies are non-blocking; on CUDA synchronize before `out`'s bytes leave."""
    n = next(iter(codes.values())).shape[0] if codes else 0
    total = layout.nbytes(n)
    assert out.dtype == torch.uint8 and out.numel() >= total, (out.dtype, out.numel(), total)
    pos = 0
    for layer, kind, shape in layout.fields:
        x = codes[(layer, kind)]
        if tuple(x.shape) != (n, *shape):
            raise ValueError(f"SCD code ({layer}, {kind}) has shape {tuple(x.shape)}, the layout wants {(n, *shape)}")
        if layout.bits:
            stream = pack_field(x, layout.bits)
        else:
            stream = x.to(layout.dtype).contiguous().view(torch.uint8).reshape(-1)
        out[pos:pos + stream.numel()].copy_(stream, non_blocking=True)
        pos += stream.numel()
    assert pos == total, (pos, total)
    return total


def unpack_codes(layout: CodeLayout, payload: torch.Tensor, tokens: int) -> dict[tuple[int, str], torch.Tensor]:
    """Views of a packed payload (uint8): {(layer, kind): [tokens, *shape]} in the codes' dtype
    (float32 copies for a quantised layout)."""
    total = layout.nbytes(tokens)
    if payload.dtype != torch.uint8 or payload.numel() < total:
        raise ValueError(f"an SCD payload of {tokens} tokens needs {total} bytes, got {payload.numel()}")
    out, pos = {}, 0
    for layer, kind, shape in layout.fields:
        nb = tokens * layout.field_bytes(shape)
        if layout.bits:
            out[(layer, kind)] = unpack_field(payload[pos:pos + nb], tokens, layout.field_elems(shape),
                                              layout.bits).view(tokens, *shape)
        else:
            out[(layer, kind)] = payload[pos:pos + nb].view(layout.dtype).view(tokens, *shape)
        pos += nb
    return out
