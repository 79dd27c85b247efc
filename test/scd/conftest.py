"""SCD test fixtures: a tiny random Llama pair (producer + two consumers with perturbed weights)."""
import pytest

from scd_tiny import TINY, perturbed, tiny_state, write_model


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """{'producer': dir, 'a': dir, 'b': dir, 'cfg': dict}: consumers a, b = producer weights + noise."""
    root = tmp_path_factory.mktemp("scd_tiny")
    sd = tiny_state(TINY, 0)
    return {"producer": write_model(root / "producer", TINY, sd),
            "a": write_model(root / "a", TINY, perturbed(sd, 0.15, 1)),
            "b": write_model(root / "b", TINY, perturbed(sd, 0.3, 2)), "cfg": TINY}
