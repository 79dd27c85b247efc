import pytest
import torch


@pytest.fixture(scope="module")
def engine(smollm2_path):
    from sgl_kvxfer import Engine

    with Engine(smollm2_path, max_total_tokens=20000, chunked_prefill_size=256) as eng:
        yield eng


@pytest.fixture(scope="module")
def hf_model(smollm2_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
