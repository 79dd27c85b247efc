"""The SCD quick start (sgl_kvxfer/scd/README.md, "Quick start on CPU") runs exactly as printed:
its bash block, run from the repo root, builds the toy models and artifacts, serves them over PD
and both specialists report a successful SCD transfer."""
import importlib.util
import os
import re
import signal
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def quickstart_block() -> str:
    text = open(os.path.join(ROOT, "sgl_kvxfer", "scd", "README.md")).read()
    section = text.split("## Quick start on CPU", 1)[1]
    return re.search(r"```bash\n(.*?)\n```", section, re.S).group(1)


def _mooncake_loads() -> bool:
    if importlib.util.find_spec("mooncake") is None:
        return False
    r = subprocess.run(["python", "-c", "import mooncake.engine"], capture_output=True)
    return r.returncode == 0


def test_block_has_no_placeholders_or_machine_paths():
    block = quickstart_block()
    assert "$SCD_QS" in block and "/tmp" not in block
    assert not re.search(r"/(work|home|root)/", block)  # no machine paths
    assert not re.search(r"\b(ARTS|CODE_MODEL|PROSE_MODEL|MODEL_DIR)\b", block)


@pytest.mark.slow
@pytest.mark.heavy  # ~45 s on 2 cores; test/disagg/test_scd_serving.py serves the same toy models over PD
@pytest.mark.skipif(not _mooncake_loads(), reason="Mooncake's transfer engine does not load here (libibverbs)")
def test_quickstart_runs_as_printed():
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # its own process group: servers a failed step leaves behind are stopped with it
    proc = subprocess.Popen(["bash", "-c", "set -eo pipefail\n" + quickstart_block()], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=2400)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, out[-3000:] + err[-5000:]
    lines = [l for l in out.splitlines() if l.startswith("ok ")]
    assert sorted(l.split()[1] for l in lines) == ["code", "qa"], out[-3000:]
