"""The native CPU kernels' build: keyed per install, built once under a lock that dies with its
owner (sgl_kvxfer/utils/locked_build.py), and never started by test collection.

The lock tests run real builder processes with a stand-in build (a sleep and a file), so they
exercise the same flock and rename as the C++ build in seconds.
"""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from sgl_kvxfer.kernels import cpu_ops
from sgl_kvxfer.utils.locked_build import build_once

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A builder process: announces through build_once, then its build sleeps `hold` seconds and
# writes `done` naming its pid.
BUILDER = textwrap.dedent("""
    import os, sys, time
    from sgl_kvxfer.utils.locked_build import build_once
    final, hold = sys.argv[1], float(sys.argv[2])
    def build(tmp):
        time.sleep(hold)
        open(os.path.join(tmp, "done"), "w").write(str(os.getpid()))
    build_once(final, build, "done", "a test build")
""")


def _start_builder(final: str, hold: float) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", BUILDER, final, str(hold)], env=env,
                            stderr=subprocess.PIPE, text=True)
    line = proc.stderr.readline()  # the builder holds the lock once it announces the build
    assert "building a test build" in line, line + proc.stderr.read()
    return proc


def test_two_installs_on_one_machine_never_share_a_build(monkeypatch):
    key = cpu_ops.build_key()
    other_venv = {**key, "install": key["install"] + "-other"}
    other_torch = {**key, "torch": "2.99.0 /elsewhere/site-packages/torch"}
    other_compiler = {**key, "compiler": key["compiler"] + " (another version)"}
    dirs = {cpu_ops.build_dir(k) for k in (key, other_venv, other_torch, other_compiler)}
    assert len(dirs) == 4
    assert cpu_ops.build_dir() == cpu_ops.build_dir(key)  # stable within an install
    # a capped ISA level is a different binary too
    monkeypatch.setenv("SGL_KVXFER_CPU_ISA", "baseline")
    assert cpu_ops.build_key()["isa"] == "baseline" and cpu_ops.build_dir() != cpu_ops.build_dir(key)
    monkeypatch.setenv("SGL_KVXFER_KERNEL_CACHE", "/some/root")
    assert cpu_ops.build_dir().startswith("/some/root/cpu_ops_baseline_")


def test_a_killed_builder_leaves_nothing_that_blocks(tmp_path):
    final = str(tmp_path / "build")
    proc = _start_builder(final, hold=600)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert list(tmp_path.glob("build.part-*")), "the dead builder's private folder is left"
    start = time.perf_counter()
    built = build_once(final, lambda tmp: open(os.path.join(tmp, "done"), "w").write("me"), "done", "x")
    assert built and open(os.path.join(final, "done")).read() == "me"
    assert time.perf_counter() - start < 5, "the next process builds at once, no stale-lock wait"
    assert not list(tmp_path.glob("build.part-*")), "leftovers of dead builders are removed"


def test_a_live_builder_is_waited_for_and_its_build_used(tmp_path, capfd):
    final = str(tmp_path / "build")
    proc = _start_builder(final, hold=1.5)

    def must_not_build(tmp):
        raise AssertionError("a second process built while a live builder held the lock")

    assert build_once(final, must_not_build, "done", "a test build") is False
    assert open(os.path.join(final, "done")).read() == str(proc.pid)
    assert proc.wait(60) == 0
    assert f"waiting for process {proc.pid}" in capfd.readouterr().err
    # complete: later calls return at once without the lock
    assert build_once(final, must_not_build, "done", "a test build") is False


def test_a_failed_build_leaves_nothing(tmp_path):
    final = str(tmp_path / "build")

    def fails(tmp):
        open(os.path.join(tmp, "half"), "w").write("x")
        raise OSError("compiler crashed")

    with pytest.raises(OSError):
        build_once(final, fails, "done", "x")
    assert not os.path.exists(final) and not list(tmp_path.glob("build.part-*"))


def test_collection_builds_nothing(tmp_path):
    """`pytest --collect-only` over the whole suite, with an empty kernel cache: no build starts
    (a build takes minutes) and no kernel folder appears."""
    cache = tmp_path / "kernels"
    env = {**os.environ, "SGL_KVXFER_KERNEL_CACHE": str(cache)}
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          os.path.join(ROOT, "test")], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "building" not in out.stderr and not cache.exists(), out.stderr[-2000:]
