"""benchmarks/quality/retrieval_tiers.py answers bad cold-tier flags with an argparse error (exit 2)
before it loads anything."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("flag,value,message", [
    ("--promote-max-tokens", "-1", "--promote-max-tokens must be in [0, 1048576]"),
    ("--promote-max-tokens", str(1 << 21), "--promote-max-tokens must be in [0, 1048576]"),
    ("--promote-max-tokens", "1.5", "invalid int value"),
    ("--promote-drop-run", "5000", "--promote-drop-run must be in [0, 4096]"),
])
def test_bad_cold_tier_flag_is_an_argparse_error(tmp_path, flag, value, message):
    cmd = [sys.executable, os.path.join("benchmarks", "quality", "retrieval_tiers.py"), "--model", str(tmp_path),
           flag, value, "--out-dir", str(tmp_path / "out")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-600:]
    assert not (tmp_path / "out").exists()
