"""utils/host_runtime.py: the scheduler's intra-op thread cap, GIL switch interval and collector
freeze, and GCStats."""
from __future__ import annotations

import gc
import sys

import pytest
import torch

from sgl_kvxfer import env
from sgl_kvxfer.utils.host_runtime import (AUTO_GIL_SWITCH_US, GCStats, gc_freeze_wanted, gil_switch_us,
                                           has_host_compute, release_scheduler_host, scheduler_threads,
                                           settle_scheduler_host)


def test_scheduler_threads_auto_caps_gpu_only():
    assert scheduler_threads("cuda", "auto") == 1
    assert scheduler_threads("cuda:1", None) == 1
    assert scheduler_threads("cpu", "auto") is None  # CPU models compute on these threads
    assert scheduler_threads("cuda", "0") is None
    assert scheduler_threads("cpu", "3") == 3
    assert scheduler_threads("cuda", "auto", host_compute=True) is None  # a cold tier's host gathers
    assert scheduler_threads("cuda", "2", host_compute=True) == 2


def test_host_compute_is_a_cold_tier():
    class Tiering:
        cold = None

    class Sched:
        tiering = Tiering()

    assert not has_host_compute(Sched()) and not has_host_compute(object())
    Sched.tiering.cold = object()
    assert has_host_compute(Sched())


@pytest.mark.parametrize("spec", ["-1", "many"])
def test_scheduler_threads_rejects_bad_counts(spec):
    with pytest.raises(ValueError, match="SGL_KVXFER_SCHEDULER_THREADS"):
        scheduler_threads("cuda", spec)


def test_gc_freeze_wanted():
    assert gc_freeze_wanted("cuda", "auto") and not gc_freeze_wanted("cpu", "auto")
    assert gc_freeze_wanted("cpu", "1") and not gc_freeze_wanted("cuda", "0")
    with pytest.raises(ValueError, match="SGL_KVXFER_GC_FREEZE"):
        gc_freeze_wanted("cuda", "sometimes")


def test_settle_on_cpu_changes_nothing_by_default(monkeypatch):
    monkeypatch.delenv(env.GC_FREEZE.name, raising=False)
    monkeypatch.delenv(env.SCHEDULER_THREADS.name, raising=False)
    monkeypatch.delenv(env.GIL_SWITCH_US.name, raising=False)
    threads, switch = torch.get_num_threads(), sys.getswitchinterval()
    facts = settle_scheduler_host("cpu")
    assert facts == {"torch_threads": threads, "gil_switch_us": round(switch * 1e6),
                     "gil_switch_was_us": round(switch * 1e6), "gc_frozen": 0}
    assert sys.getswitchinterval() == switch


def test_gil_switch_us():
    assert gil_switch_us("cuda", "auto") == AUTO_GIL_SWITCH_US and gil_switch_us("cuda:1", None) == 200
    assert gil_switch_us("cpu", "auto") is None  # Python's own interval
    assert gil_switch_us("cuda", "0") is None and gil_switch_us("cpu", "50") == 50
    for spec in ("fast", "-1", "0.5"):
        with pytest.raises(ValueError, match="SGL_KVXFER_GIL_SWITCH_US"):
            gil_switch_us("cuda", spec)


def test_settle_sets_the_switch_interval_and_release_restores_it(monkeypatch):
    monkeypatch.setenv(env.GIL_SWITCH_US.name, "300")
    before = sys.getswitchinterval()
    try:
        facts = settle_scheduler_host("cpu")
        assert facts["gil_switch_us"] == 300 and sys.getswitchinterval() == pytest.approx(300e-6)
        release_scheduler_host(facts)
        assert sys.getswitchinterval() == pytest.approx(before)
    finally:
        sys.setswitchinterval(before)


def test_settle_freezes_and_release_unfreezes(monkeypatch):
    monkeypatch.setenv(env.GC_FREEZE.name, "1")
    monkeypatch.setenv(env.SCHEDULER_THREADS.name, "1")
    threads = torch.get_num_threads()
    try:
        facts = settle_scheduler_host("cpu")
        assert facts["torch_threads"] == 1 == torch.get_num_threads()
        # frozen objects that die afterwards leave the permanent generation (threads left by
        # earlier tests free some), so the count may only fall from the one settle saw
        assert facts["gc_frozen"] > 0 and 0 < gc.get_freeze_count() <= facts["gc_frozen"]
        release_scheduler_host(facts)
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
        torch.set_num_threads(threads)


def test_gc_stats_count_collections_per_generation():
    stats = GCStats()
    try:
        gc.collect(0)
        gc.collect(2)
        snap = stats.snapshot()
        assert snap["collections"][0] >= 1 and snap["collections"][2] >= 1
        assert snap["total_ms"] == pytest.approx(sum(snap["ms"]))
        stats.reset()
        assert stats.snapshot()["collections"] == [0, 0, 0]
    finally:
        stats.close()
    assert stats._on_gc not in gc.callbacks
