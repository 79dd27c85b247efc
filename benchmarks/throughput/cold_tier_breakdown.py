"""Where a decode step's time goes while the cold tier runs: one synchronized, timed generate call.

    with HookTimer(engine) as timer:
        engine.generate(...)
    timer.result() -> {"decode_steps", "wall_s", "seconds": {part: s}, "calls": {part: n},
                       "ms_per_decode_step": {part: ms}, "forward_decode_ms": [ms per step, in order],
                       "scheduler_step_ms": [ms per scheduler step, in order],
                       "graph_replays", "cuda_graphs"}

Parts (each wrapped call is synchronized before and after on CUDA, so GPU work it enqueues is
charged to it):

    forward_decode / forward_extend   ModelRunner.forward (graph replay or eager)
    cold_score                        ColdTier._score (the scoring pass and the promotions it issues)
    cold_prepare                      ColdTier._prepare (the landing in the forward's window: plan,
                                      and where the copies fit, copy slots, row repair, table write;
                                      in a run it overlaps the decode forward, here it is synchronized
                                      after it)
    cold_land                         ColdTier._land (a plan that did not fit applied after the
                                      forward, deferred frees; the whole landing where none ran)
    cold_release                      ColdTier.release_request (the row given back at the end)
    decode_demotion                   EngineTiering._demote_runs (generated tokens re-tiered)
    make_room                         RadixCache.evict (cache leaves freed for a short store)

`other` is the call's wall time less all of them: the scheduler's host loop, sampling, outputs.

Inside cold_score and cold_land, their pieces are timed too (synchronized the same way) and
reported apart, in `cold_parts` / `cold_parts_ms_per_decode_step` as "<part>.<piece>" (they are
already inside their part's time):

    rows        ColdTier._due_block (cold_score.due_block: the due rows and candidates, on the device)
    mass        decode_mass.pool_mass as cold_score calls it (the scoring kernel, or route + keys +
                softmax off CUDA)
    select      ColdTier._select (cold_score.select: hits, picks, their read-back)
    cap         ColdTier._cap (cold_score.cap)                  issue   ColdTier._issue (staging, copy)
    read_rows   ColdTier._mirror_block (cold_land.mirror_block: landing rows from the host mirrors)
    plan        ColdTier._plan (cold_land.find_holes: every row's holes, host only)
    copies      ColdTier._copies (cold_land.plan_copies: the repair copies' slots)
    move        TieredKVPool.move (cold_land.repair_pages: page repair)
    rewrite     ColdTier._rewrite (cold_land.rewrite_rows: the table write)

The pass's copy job runs on the copy worker's thread (CUDA; cold_copy.py), beside the scheduler
thread, so it is in none of the parts; its wall time is reported apart, unsynchronized, as
"copy_worker.job" (gather, pinned staging, enqueueing) and "copy_worker.gather" (HostColdStore.gather
inside it): what the worker is busy with while `other` runs.

The syncs cost a little, so this call is a diagnostic, not the throughput number.
"""
from __future__ import annotations

import threading
import time

import torch


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _synced_start() -> float:
    """The clock after the device's queued work is done (so a timed call is charged its own)."""
    _sync()
    return time.perf_counter()


def _synced_since(t: float) -> float:
    """Seconds since `t` once the work enqueued since is done."""
    _sync()
    return time.perf_counter() - t


class HookTimer:
    def __init__(self, engine):
        self.engine = engine
        self.runner = engine.runner
        self.tiering = getattr(engine.scheduler, "tiering", None)
        self.cold = getattr(self.tiering, "cold", None)
        self.tree = getattr(engine.scheduler.kv, "tree", None)
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.step_ms: list[float] = []  # each decode forward, in order: a jump after a landing shows
        self.sched_ms: list[float] = []  # each scheduler step (prefill or decode), in order
        self._undo: list = []
        self._depth = 0  # nested wrapped calls (a landing inside a scoring hook) are charged once
        self._outer = None  # the cold part running now: its pieces are charged to it
        self.pieces: dict[str, float] = {}
        self._lock = threading.Lock()  # the copy worker's thread adds to `pieces` too

    def _patch(self, obj, attr: str, make) -> None:
        """Replace `obj.attr` by make(real) until __exit__ (which restores it); absent: nothing."""
        if obj is None or not hasattr(obj, attr):
            return
        had_own = attr in vars(obj)
        real = getattr(obj, attr)
        setattr(obj, attr, make(real))
        self._undo.append((obj, attr, real if had_own else None))

    def _wrap(self, obj, attr: str, part) -> None:
        def make(real):
            def timed(*args, **kwargs):
                name = part(*args, **kwargs) if callable(part) else part
                if self._depth:
                    return real(*args, **kwargs)
                self._depth += 1
                self._outer = name if name.startswith("cold_") and name != "cold_release" else None
                t = _synced_start()
                try:
                    return real(*args, **kwargs)
                finally:
                    dt = _synced_since(t)
                    self._depth -= 1
                    self._outer = None
                    self.seconds[name] = self.seconds.get(name, 0.0) + dt
                    self.calls[name] = self.calls.get(name, 0) + 1
                    if name == "forward_decode":
                        self.step_ms.append(1e3 * dt)
            return timed
        self._patch(obj, attr, make)

    def _wrap_piece(self, obj, attr: str, piece: str) -> None:
        """Time `obj.attr` (synchronized) when a cold part runs it, charged as "<part>.<piece>"."""
        def make(real):
            def timed(*args, **kwargs):
                outer = self._outer
                if outer is None:
                    return real(*args, **kwargs)
                t = _synced_start()
                try:
                    return real(*args, **kwargs)
                finally:
                    key = f"{outer}.{piece}"
                    self.pieces[key] = self.pieces.get(key, 0.0) + _synced_since(t)
            return timed
        self._patch(obj, attr, make)

    def _wrap_worker(self, obj, attr: str, piece: str) -> None:
        """Time `obj.attr` wherever it runs (the copy worker's thread), unsynchronized, charged as
        "copy_worker.<piece>"."""
        def make(real):
            def timed(*args, **kwargs):
                t = time.perf_counter()
                try:
                    return real(*args, **kwargs)
                finally:
                    dt, key = time.perf_counter() - t, f"copy_worker.{piece}"
                    with self._lock:
                        self.pieces[key] = self.pieces.get(key, 0.0) + dt
            return timed
        self._patch(obj, attr, make)

    def _wrap_steps(self, scheduler) -> None:
        """Each scheduler step's wall time, in order (not synchronized; the parts above are)."""
        def make(real):
            def step(*args, **kwargs):
                t = time.perf_counter()
                try:
                    return real(*args, **kwargs)
                finally:
                    self.sched_ms.append(1e3 * (time.perf_counter() - t))
            return step
        self._patch(scheduler, "step", make)

    def __enter__(self) -> "HookTimer":
        self._wrap_steps(getattr(self.engine, "scheduler", None))
        self._wrap(self.runner, "forward",
                   lambda batch, *a, **k: "forward_decode" if batch.mode.name == "DECODE" else "forward_extend")
        self._wrap(self.cold, "_score", "cold_score")
        self._wrap(self.cold, "_prepare", "cold_prepare")
        self._wrap(self.cold, "_land", "cold_land")
        self._wrap(self.cold, "release_request", "cold_release")
        self._wrap(self.tiering, "_demote_runs", "decode_demotion")
        self._wrap(self.tree, "evict", "make_room")
        if self.cold is not None:
            import sgl_kvxfer.scheduler.cold_score as score_module  # its pool_mass is the one the pass calls

            pool = self.cold.pool  # its move is the landing's page repair
            for obj, attr, piece in ((self.cold, "_due_block", "rows"), (score_module, "pool_mass", "mass"),
                                     (self.cold, "_select", "select"), (self.cold, "_mirror_block", "read_rows"),
                                     (self.cold, "_cap", "cap"), (self.cold, "_issue", "issue"),
                                     (self.cold, "_plan", "plan"), (self.cold, "_copies", "copies"),
                                     (pool, "move", "move"),
                                     (self.cold, "_rewrite", "rewrite")):
                self._wrap_piece(obj, attr, piece)
            import sgl_kvxfer.scheduler.cold_tier as tier_module  # its copy_job is the one _issue submits

            self._wrap_worker(tier_module, "copy_job", "job")
            self._wrap_worker(self.cold.store, "gather", "gather")
        graphs = self.runner.graph_runner
        self._replays = graphs.replays if graphs is not None else None
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s = time.perf_counter() - self._t0
        for obj, attr, real in reversed(self._undo):
            if real is None:
                delattr(obj, attr)  # the class's method shows through again
            else:
                setattr(obj, attr, real)
        self._undo = []

    def result(self) -> dict:
        graphs = self.runner.graph_runner
        steps = self.calls.get("forward_decode", 0)
        seconds = dict(self.seconds)
        seconds["other"] = max(0.0, self.wall_s - sum(self.seconds.values()))
        return {"decode_steps": steps, "wall_s": self.wall_s, "seconds": seconds, "calls": dict(self.calls),
                "ms_per_decode_step": {k: 1e3 * v / max(1, steps) for k, v in seconds.items()},
                "forward_decode_ms": [round(x, 3) for x in self.step_ms],
                "scheduler_step_ms": [round(x, 3) for x in self.sched_ms],
                "cold_parts": dict(self.pieces),
                "cold_parts_ms_per_decode_step": {k: 1e3 * v / max(1, steps) for k, v in self.pieces.items()},
                "graph_replays": None if graphs is None else graphs.replays - self._replays,
                "cuda_graphs": graphs is not None}
