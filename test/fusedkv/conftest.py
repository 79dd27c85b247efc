"""Fixtures of the FusedKV offline tests (fkv_tiny.py)."""
import pytest
from fkv_tiny import jsonl_dir, tiny_model_dir


@pytest.fixture
def tiny_model(tmp_path):
    return tiny_model_dir(tmp_path / "model")


@pytest.fixture
def text_data(tmp_path):
    return jsonl_dir(tmp_path / "data")
