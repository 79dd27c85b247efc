"""Shared pytest setup: markers and the embedded default model (converted once per machine)."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running test (model conversion, real weights)")
    config.addinivalue_line("markers", "gpu: needs a CUDA device")


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """Local HF-format dir of the embedded SmolLM2-135M-Instruct (converts on first use)."""
    from sgl_kvxfer.models.loader import resolve_model_path

    return resolve_model_path(None)
