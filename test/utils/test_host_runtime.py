"""utils/host_runtime.py: the scheduler's intra-op thread cap and collector freeze, and GCStats."""
from __future__ import annotations

import gc

import pytest
import torch

from sgl_kvxfer import env
from sgl_kvxfer.utils.host_runtime import (GCStats, gc_freeze_wanted, has_host_compute, release_scheduler_host,
                                           scheduler_threads, settle_scheduler_host)


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
    threads = torch.get_num_threads()
    facts = settle_scheduler_host("cpu")
    assert facts == {"torch_threads": threads, "gc_frozen": 0}


def test_settle_freezes_and_release_unfreezes(monkeypatch):
    monkeypatch.setenv(env.GC_FREEZE.name, "1")
    monkeypatch.setenv(env.SCHEDULER_THREADS.name, "1")
    threads = torch.get_num_threads()
    try:
        facts = settle_scheduler_host("cpu")
        assert facts["torch_threads"] == 1 == torch.get_num_threads()
        assert facts["gc_frozen"] > 0 and gc.get_freeze_count() == facts["gc_frozen"]
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
