"""benchmarks/quality/scd_code_floor.py end to end on the tiny random model paired with itself:
one calibration per code dtype and scale, the JSON (device, commit, command, per-layer errors,
log-prob) and the PNG. The numbers are not checked here (the unit-code fit has its own tests in
test_unit_codes.py); this shows the script still runs."""
import json
import os
import subprocess
import sys

import pytest
from test_calibrate import synthetic_calib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.heavy  # a script's smoke run of about 12 s on 2 cores: CI leaves it out (README, Tests)
def test_code_floor_script_writes_json_and_png(tiny_pair, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "benchmarks/quality/scd_code_floor.py", "--model", tiny_pair["producer"],
           "--calib", *synthetic_calib(tmp_path), "--code-dtypes", "int4", "--scales", "none", "unit",
           "--num-prefixes", "8", "--prefix-len", "48", "--select-prompts", "3", "--select-prefix", "16",
           "--select-cont", "6", "--r-k", "8", "--r-v", "8", "--rank-levels", "4:4", "--r-h", "16",
           "--name", "floor", "--out-dir", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    data = json.loads((out / "floor.json").read_text())
    assert data["device"] and data["commit"] and data["command"].startswith("python benchmarks/quality/scd_code_floor.py")
    assert [(r["code_dtype"], r["code_scale"]) for r in data["runs"]] == [("int4", "none"), ("int4", "unit")]
    for r in data["runs"]:
        assert len(r["reuse_k_rel_err"]) == len(r["reuse_v_rel_err"]) > 0
        assert r["F_loss"] == r["F_own"] - r["F_codes"] and r["bytes_per_token"] > 0
        assert "--out OUT" in r["calib_command"] and str(tmp_path) + "/tmp" not in r["calib_command"]
    assert (out / "floor.png").is_file()
    assert not [n for n in os.listdir(tmp_path) if n.startswith("tmp")], "the script left its temp folder"
