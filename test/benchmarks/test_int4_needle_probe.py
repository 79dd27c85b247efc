"""benchmarks/quality/int4_needle_probe.py: its int4 masks, its flags, and a run on a tiny model."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "quality"))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_masks_put_int4_where_each_condition_says():
    from int4_needle_probe import masks

    for seed in range(20):
        m = masks(100, (40, 52), 4, random.Random(seed))
        assert not m["fp16"].any() and m["int4-needle"].nonzero().flatten().tolist() == list(range(40, 52))
        rand = m["int4-random"].nonzero().flatten()
        # as many tokens, one run, off the line and off the sinks
        assert rand.numel() == 12 and int(rand[-1] - rand[0]) == 11
        assert not (m["int4-random"] & m["int4-needle"]).any() and not m["int4-random"][:4].any()
        assert m["int4-all"].sum() == 96 and not m["int4-all"][:4].any()
        assert (m["int4-all-but-needle"] | m["int4-needle"]).equal(m["int4-all"] | m["int4-needle"])
        assert not (m["int4-all-but-needle"] & m["int4-needle"]).any()


@pytest.mark.parametrize("args,message", [
    (["--beds", "3"], "NEAR_KEYS:NEAR_VALUES"), (["--beds", "17:0"], "near keys in [0, 16]"),
    (["--beds", "3:x"], "NEAR_KEYS:NEAR_VALUES"), (["--beds", "3:10"], "fewer than --value-digits"),
    (["--items", "0"], "--items in [1, 10000]"), (["--context", "nan"], "invalid int value"),
    (["--seed", "-1"], "--seed in [0, 2**31)"), (["--dtype", "int8"], "invalid choice"),
])
def test_bad_flags_are_argparse_errors(args, message):
    proc = subprocess.run([sys.executable, os.path.join("benchmarks", "quality", "int4_needle_probe.py"), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-600:]


@pytest.mark.heavy  # over 10 s on 2 cores: CI leaves it out (README, Tests)
@pytest.mark.slow
def test_runs_on_a_tiny_model(tmp_path):
    from tiny_models import tiny_task_model

    model = tiny_task_model(tmp_path)
    out = tmp_path / "probe.json"
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, os.path.join("benchmarks", "quality", "int4_needle_probe.py"), "--model",
                           model, "--device", "cpu", "--dtype", "float32", "--context", "128", "--items", "2",
                           "--value-digits", "6", "--beds", "3:0", "4:2", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert set(data["beds"]) == {"3:0", "4:2"}
    for bed in data["beds"].values():
        assert len(bed["rows"]) == 2  # every item's asked line found
        s = bed["summary"]
        assert all(0 <= s[c]["em_pct"] <= 100 and s[c]["nll"] >= 0 for c in ("fp16", "int4-needle", "int4-all"))
        for row in bed["rows"]:  # int4 changes the answer's log-prob (the random model's too)
            assert row["int4-all"]["nll"] != row["fp16"]["nll"]
