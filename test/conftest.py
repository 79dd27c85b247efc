"""Shared pytest setup: markers, the embedded default model (converted once per machine), a
private temp root, and the CPU ISA cap.

- Every temp file of the run (pytest's tmp_path, server logs, ipc sockets, what child processes
  write to $TMPDIR) goes under one fresh folder, removed when the run ends: a run leaves nothing
  in /tmp. (KEEP_TEST_TMP=1 keeps it, for reading server logs after a failure.)
- SGL_KVXFER_CPU_ISA=avx2 (sgl_kvxfer/utils/cpu_isa.py) runs the suite on an AVX-512 machine as
  an AVX2-only CPU runs it: our native paths take the cap themselves, and torch's own oneDNN /
  ATen dispatch is capped here, before torch starts, for this process and every server it spawns.
"""
import os
import shutil
import tempfile

from sgl_kvxfer.testing.servers import load_factor
from sgl_kvxfer.utils.cpu_isa import torch_cap_env

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# pytest-timeout: no test hangs the run; 900 s of an idle machine, stretched by the load at start
os.environ.setdefault("PYTEST_TIMEOUT", str(round(900 * load_factor())))
for _name, _value in torch_cap_env().items():
    os.environ.setdefault(_name, _value)
TMP_ROOT = tempfile.mkdtemp(prefix="sgl_kvxfer_tests_")
os.environ["TMPDIR"] = TMP_ROOT
tempfile.tempdir = None  # re-read TMPDIR

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton kernels are built when their module is imported: on a CPU-only machine the
# interpreter must be on before any test module imports them (kernels or engine backend).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest-xdist: the workers share the cores, so each worker's own torch ops take its share of
# them (two workers of two intra-op threads each on 2 cores made the in-process model tests 5x
# slower than one worker); servers a test starts keep their own defaults
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running test (model conversion, real weights)")
    config.addinivalue_line("markers", "gpu: needs a CUDA device")
    config.addinivalue_line("markers", "heavy: a benchmark smoke run of over 5 s on 2 cores, or an end-to-end run of "
                                       "tens of seconds or more whose path a cheaper test also covers; CI's "
                                       "`-m \"not heavy\"` leaves it out, `-m heavy` runs the set")
    if not config.option.basetemp:
        config.option.basetemp = os.path.join(TMP_ROOT, "pytest")


def pytest_unconfigure(config):
    if os.environ.get("KEEP_TEST_TMP") == "1":
        print(f"\nkept the run's temp folder: {TMP_ROOT}")
        return
    shutil.rmtree(TMP_ROOT, ignore_errors=True)


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


@pytest.fixture(scope="session")
def native_cpu_ops():
    """The native CPU kernels, built (or loaded) when the first test that needs them runs, never
    at collection; a machine where they cannot build skips those tests with the reason."""
    from sgl_kvxfer.kernels import cpu_ops

    if not cpu_ops.available():
        pytest.skip(cpu_ops.load_error())
    return cpu_ops


@pytest.fixture(scope="module")
def tiny_preset_dir(tmp_path_factory) -> str:
    """A dummy-weights model dir of the `tiny` preset (models/presets.py) with a dummy tokenizer
    of the preset's vocabulary."""
    from sgl_kvxfer.models.presets import PRESETS, write_dummy_tokenizer, write_preset_config

    d = str(tmp_path_factory.mktemp("tiny"))
    write_preset_config("tiny", d)
    write_dummy_tokenizer(d, PRESETS["tiny"]["vocab_size"])
    return d


@pytest.fixture(scope="module")
def tiny_dir(request, tmp_path_factory) -> str:
    """A dummy-weights model dir of the requesting test module's `TINY` config (tiny_models.py)."""
    from tiny_models import write_tiny_model

    return write_tiny_model(str(tmp_path_factory.mktemp("tiny_llama")), request.module.TINY)
