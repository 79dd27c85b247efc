"""Kernel tests: the Triton interpreter on CPU, real kernels on CUDA.

TRITON_INTERPRET must be set before any @triton.jit function is *defined*, i.e. before the
kernel modules are imported: test/conftest.py sets it at conftest import time, and there also
registers the `gpu` marker and skips `gpu` tests (real shapes) without CUDA.
"""
import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device():
    return DEVICE
