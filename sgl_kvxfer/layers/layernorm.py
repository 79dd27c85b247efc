"""RMSNorm, the one normalisation layer of the Llama family."""
from __future__ import annotations

import torch
from torch import nn

from sgl_kvxfer.layers import fused_ops


class RMSNorm(nn.Module):
    """HF-exact RMSNorm (float32 statistics), with optional fused residual add.
    One Triton launch on CUDA fp16/bf16 (`fused_ops.rmsnorm`)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x [T, H] -> normed [T, H]; with residual: (normed(x + residual), x + residual)."""
        return fused_ops.rmsnorm(x, self.weight, self.eps, residual)
