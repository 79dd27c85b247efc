"""The cold tier's promotion copies (scheduler/cold_tier.py): one per scoring pass, host rows ->
fresh fp16 slots, run off the scheduler thread on CUDA.

    copy = PromotionCopy()
    worker.submit(copy, job)   job(copy) gathers the host rows and enqueues the device copy; on
                               CUDA it runs on the worker thread, in submission order
    copy.query() -> bool       the job ran and its device work completed (never waits)
    copy.wait(stream)          block until the job ran, then order `stream` after its device work

The scheduler thread keeps deciding and landing; the worker only reads host rows (pinned, held by
the promoting requests until they land or are released: release_request waits for the job
first) and writes fp16 slots nobody's row points at yet, on the cold tier's side stream.
NOTE: a job that raises marks its copy failed; query() raises on the scheduler thread then.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable


class PromotionCopy:
    def __init__(self):
        self.event = None  # CUDA event after the copy's device work (set by the job); None: no device work
        self.keep: tuple = ()  # staging tensors the device copy reads: alive until every landing of the pass
        self.ids_ready = None  # CUDA event: the pass's fp16 ids are on the host (ColdTier._host_ids); None: they are
        self.error: BaseException | None = None
        self._ran = threading.Event()

    def finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self._ran.set()

    def query(self) -> bool:
        if not self._ran.is_set():
            return False
        if self.error is not None:
            raise RuntimeError("a cold-tier promotion copy failed") from self.error
        return self.event is None or self.event.query()

    def wait_ids(self) -> None:
        """Block until the pass's fp16 ids have reached the host (a copy behind the step in flight
        when the pass ran: done once that step is)."""
        if self.ids_ready is not None:
            self.ids_ready.synchronize()

    def wait(self, stream=None) -> None:
        self._ran.wait()
        if self.event is not None and stream is not None:
            stream.wait_event(self.event)


class CopyWorker:
    """Runs copy jobs in submission order: on one worker thread, or inline (`threaded` False)."""

    def __init__(self, threaded: bool):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cold-tier-copy") if threaded else None

    def submit(self, copy: PromotionCopy, job: Callable[[PromotionCopy], None]) -> None:
        if self._pool is None:
            job(copy)
            copy.finish()
            return
        self._pool.submit(_run, copy, job)


def _run(copy: PromotionCopy, job) -> None:
    try:
        job(copy)
    except BaseException as exc:  # noqa: BLE001 - handed to the scheduler thread by query()
        copy.finish(exc)
        return
    copy.finish()
