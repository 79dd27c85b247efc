"""Shared pytest setup: markers and the embedded default model (converted once per machine)."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

# Triton kernels are built when their module is imported: on a CPU-only machine the
# interpreter must be on before any test module imports them (kernels or engine backend).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running test (model conversion, real weights)")
    config.addinivalue_line("markers", "gpu: needs a CUDA device")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """Local HF-format dir of the embedded SmolLM2-135M-Instruct (converts on first use)."""
    from sgl_kvxfer.models.loader import resolve_model_path

    return resolve_model_path(None)
