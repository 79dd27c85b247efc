"""scripts/gpu/fusedkv_all.sh's deadline and the two-GPU call's scripts, without running a stage."""
from __future__ import annotations

import os
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = ["scripts/gpu/fusedkv_all.sh", "scripts/gpu/fusedkv_x2.sh", "scripts/gpu/testbeds_x2.sh"]


def test_scripts_parse():
    for s in SCRIPTS:
        r = subprocess.run(["bash", "-n", s], cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 0, (s, r.stderr)


def test_a_stage_past_the_deadline_is_skipped_and_fails_the_call(tmp_path):
    env = {**os.environ, "DEVICE": "cpu", "OUT": str(tmp_path), "DEADLINE": str(int(time.time()) + 5)}
    r = subprocess.run(["bash", "scripts/gpu/fusedkv_all.sh", "serve"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    log = open(tmp_path / "fusedkv_all.log").read()
    assert r.returncode == 1 and "== serve skipped:" in log and "failed: serve:deadline" in log
    assert "serve_bench" not in log  # nothing started
