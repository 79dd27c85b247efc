"""SchedulerProfiler (scheduler/profiler.py): the /start_profile state machine on CPU."""
import functools
import gzip
import json
import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from sgl_kvxfer.message import ProfileReq
from sgl_kvxfer.scheduler.profiler import SchedulerProfiler, trace_path


def _trace_events(path):
    with gzip.open(path, "rb") as f:  # a gzip of torch.profiler's chrome trace
        return json.load(f)["traceEvents"]


def test_num_steps_ends_the_capture_and_writes_the_trace(tmp_path):
    prof = SchedulerProfiler()
    ok, msg = prof.start(ProfileReq(start=True, output_dir=str(tmp_path), num_steps=2, activities=["CPU"],
                                    profile_id="p1"))
    assert ok, msg
    path = trace_path(str(tmp_path), "p1")
    assert path.endswith("p1-TP-0.trace.json.gz")
    torch.ones(8) @ torch.ones(8)
    prof.after_step(False)  # a step that ran no forward does not count
    prof.after_step(True)
    assert prof.recording and not os.path.exists(path)
    prof.after_step(True)  # the second forward step ends it
    assert not prof.recording
    assert isinstance(_trace_events(path), list)
    assert os.listdir(tmp_path) == [os.path.basename(path)]  # no temporary file left


def test_errors_leave_the_state_as_it_was(tmp_path):
    prof = SchedulerProfiler()
    assert prof.stop() == (False, "No profile is running.")
    ok, msg = prof.start(ProfileReq(start=True, output_dir=str(tmp_path), activities=["CPU", "TPU"]))
    assert not ok and "activities" in msg and not prof.recording
    ok, msg = prof.start(ProfileReq(start=True, output_dir=str(tmp_path), num_steps=-1))
    assert not ok and "num_steps" in msg
    for bad in ("../escape", "a/b", "..", "nul\x00"):  # the trace stays inside output_dir
        ok, msg = prof.start(ProfileReq(start=True, output_dir=str(tmp_path), profile_id=bad))
        assert not ok and "profile_id" in msg and not prof.recording
    for bad in (str(tmp_path / "nul\x00dir"), str(tmp_path / "lone\ud800")):  # refused, not raised
        ok, msg = prof.start(ProfileReq(start=True, output_dir=bad))
        assert not ok and "output_dir" in msg and not prof.recording
    blocker = tmp_path / "file"
    blocker.write_text("")
    ok, msg = prof.start(ProfileReq(start=True, output_dir=str(blocker / "sub")))
    assert not ok and "output_dir" in msg
    if not torch.cuda.is_available():
        ok, msg = prof.start(ProfileReq(start=True, output_dir=str(tmp_path), activities=["GPU"]))
        assert not ok and "CUDA" in msg
    assert prof.start(ProfileReq(start=True, output_dir=str(tmp_path), profile_id="p2"))[0]
    ok, msg = prof.start(ProfileReq(start=True, output_dir=str(tmp_path)))
    assert not ok and "already running" in msg
    assert prof.stop()[0]
    assert _trace_events(trace_path(str(tmp_path), "p2")) is not None


def test_close_writes_a_running_capture_and_the_env_names_the_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_TORCH_PROFILER_DIR", str(tmp_path / "env_dir"))
    prof = SchedulerProfiler()
    assert prof.start(ProfileReq(start=True, profile_id="p3"))[0]
    prof.close()
    assert not prof.recording
    assert os.path.exists(trace_path(str(tmp_path / "env_dir"), "p3"))
    prof.close()  # nothing running: nothing to do


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_activity_records_cuda_kernels(tmp_path):
    prof = SchedulerProfiler()
    assert prof.start(ProfileReq(start=True, output_dir=str(tmp_path), profile_id="g"))[0]
    x = torch.ones(256, 256, device="cuda")
    (x @ x).sum().item()
    assert prof.stop()[0]
    events = _trace_events(trace_path(str(tmp_path), "g"))
    assert any(e.get("cat") == "kernel" for e in events)


def _record_until_sigterm(folder, ready):
    from types import SimpleNamespace

    from sgl_kvxfer.scheduler import process

    scheduler = SimpleNamespace(profiler=SchedulerProfiler())
    scheduler.profiler.start(ProfileReq(start=True, output_dir=folder, activities=["CPU"], profile_id="t"))
    signal.signal(signal.SIGTERM, functools.partial(process._write_profile_then_die, scheduler))
    ready.set()
    while True:
        time.sleep(0.05)


def test_sigterm_writes_a_running_capture_then_dies_by_sigterm(tmp_path):
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_record_until_sigterm, args=(str(tmp_path), ready))
    proc.start()
    assert ready.wait(120)
    proc.terminate()
    proc.join(60)
    assert proc.exitcode == -signal.SIGTERM  # as without the handler: the launcher sees the same exit
    assert isinstance(_trace_events(trace_path(str(tmp_path), "t")), list)
