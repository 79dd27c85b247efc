"""Fixtures of the benchmark tests."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def load_benchmark():
    """load_benchmark("pd/goodput.py") -> the script as a fresh module (benchmarks/ on sys.path for
    its `common` imports while the test runs), so a test can replace its servers with fakes."""
    bench = os.path.join(ROOT, "benchmarks")
    sys.path.insert(0, bench)

    def load(script: str):
        name = os.path.splitext(os.path.basename(script))[0] + "_under_test"
        spec = importlib.util.spec_from_file_location(name, os.path.join(bench, script))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    yield load
    sys.path.remove(bench)
