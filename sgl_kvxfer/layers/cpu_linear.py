"""Linears prepared once at load time, for bf16 models on CPU; the strategy follows the CPU.

`F.linear` on a bf16 CPU tensor is slow either way, for a reason that depends on the ISA
(sgl_kvxfer/utils/cpu_isa.py):

    AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT: oneDNN reorders (packs) the weight into its blocked
        layout on every call; for a decode batch that costs as much as the matmul. Here each
        weight is packed once (`torch.ops.mkldnn._reorder_linear_weight`) and every call runs
        `_linear_pointwise` on the packed copy: 1.3-1.9x faster at 32 rows, bit-identical.
    AVX2 only: oneDNN has no bf16 GEMM (the prepack raises), and ATen's bf16 fallback runs
        3-6x slower than an fp32 GEMM of the same shape. Here each weight gets an fp32 copy and
        every call is one fp32 GEMM, its output rounded to bf16 once (outputs differ from
        `F.linear`'s by fp32 summation order, at most one bf16 rounding).

The original `weight` Parameter stays in place (state_dict, parameter counts and weight loading
are unchanged); the prepared copy costs one more copy of the linear weights in host memory (two
at fp32).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sgl_kvxfer.utils import cpu_isa

# batch-size hint for the packed layout; any row count works (tested), this one is the decode case
_PACK_ROWS_HINT = 64


def can_prepack(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bf16 -> a prepared weight for `packed_linear`: an opaque oneDNN bf16 tensor
    where this CPU has oneDNN's bf16 GEMM, else an fp32 copy."""
    if (cpu_isa.onednn_bf16_linear() and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_ROWS_HINT)
    return weight.detach().float().contiguous()


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] bf16 -> x @ W^T + bias [..., N] bf16, W prepared by `pack_weight`."""
    if packed.dtype == torch.float32:
        return F.linear(x.float(), packed, None if bias is None else bias.float()).to(x.dtype)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinearCPU(nn.Module):
    """Drop-in for an nn.Linear: same `weight` / `bias` parameters, forward on the prepared copy."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.packed = pack_weight(linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias)


@torch.no_grad()
def prepack_linears_cpu(model: nn.Module) -> int:
    """Replace every bf16 CPU nn.Linear under `model` by a PackedLinearCPU; returns how many.
    Call after the weights are loaded (the prepared copies do not follow later weight writes)."""
    swaps = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) is nn.Linear and can_prepack(child.weight):
                swaps.append((parent, name, child))
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinearCPU(child))
    return len(swaps)
