"""The tiered decode kernels' loops load nothing synchronously: benchmarks/kernels/compile_report.py
compiles them for sm_90 on the CPU (the installed Triton) and counts the decode loop's loads that
Triton's software pipeliner leaves synchronous (each one a global-memory wait every step)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
