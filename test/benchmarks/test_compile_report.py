"""The tiered decode kernels' loops load nothing synchronously: benchmarks/kernels/compile_report.py
compiles them for sm_90 on the CPU (the installed Triton) and counts the decode loop's loads that
Triton's software pipeliner leaves synchronous (each one a global-memory wait every step)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.heavy  # over 10 s on 2 cores: CI leaves it out (README, Tests)
@pytest.mark.slow
@pytest.mark.parametrize("int_page,head_dim,kv_group", [(64, 128, 4), (256, 64, 3)])
def test_decode_loops_prefetch_every_load(tmp_path, int_page, head_dim, kv_group):
    out = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "kernels", "compile_report.py"),
                    "--int-page", str(int_page), "--head-dim", str(head_dim), "--kv-group", str(kv_group),
                    "--json", str(out)], check=True, env=env, cwd=ROOT, timeout=600, capture_output=True)
    rows = json.loads(out.read_text())["rows"]
    assert [r["tier"] for r in rows] == ["int8", "int4", "fp16"]
    for r in rows:
        assert r["synchronous"] == 0 and r["prefetched"] >= 3, r
        assert r["spill_stack_bytes"] == 0, r


def test_bad_flags_are_refused():
    for bad in (["--config", "[1]"], ["--config", '{"tile8": 100}'], ["--kv-group", "0"], ["--int-page", "48"],
                ["--head-dim", "100"]):
        r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "kernels", "compile_report.py"), *bad],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and "error" in r.stderr, (bad, r.stderr[-300:])


@pytest.mark.heavy  # a compile report of about 13 s on 2 cores: CI leaves it out (README, Tests)
@pytest.mark.slow
def test_conversion_knobs_shorten_the_int_loops(tmp_path):
    """dot_cvt + sub_cvt: the int loops keep every load prefetched and no spill, and their SASS
    body is shorter than the default conversion's (no bias subtraction, no nibble shift)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    rows = {}
    for name, cfg in (("base", "{}"), ("knobs", '{"dot_cvt": true, "sub_cvt": true}')):
        out = tmp_path / f"{name}.json"
        subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "kernels", "compile_report.py"),
                        "--int-page", "256", "--tiers", "int8", "int4", "--config", cfg, "--json", str(out)],
                       check=True, env=env, cwd=ROOT, timeout=600, capture_output=True)
        rows[name] = {r["tier"]: r for r in json.loads(out.read_text())["rows"]}
    for tier in ("int8", "int4"):
        base, knobs = rows["base"][tier], rows["knobs"][tier]
        assert knobs["synchronous"] == 0 and knobs["spill_stack_bytes"] == 0, knobs
        assert knobs["loop_sass"]["instructions"] < base["loop_sass"]["instructions"], (base, knobs)
        assert knobs["loop_sass"].get("HADD2", 0) < base["loop_sass"].get("HADD2", 0), (base, knobs)
