"""Kernel tests: interpreter on CPU, real kernels on CUDA.

TRITON_INTERPRET must be set before any @triton.jit function is *defined*, i.e. before the
kernel modules are imported, so it is set here at conftest import time. Tests marked
`gpu` run real shapes and are skipped without CUDA.
"""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = "cuda" if HAS_CUDA else "cpu"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA; runs kernels at real shapes")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    return DEVICE
