"""The scheduler process's host runtime: the garbage collector, torch's intra-op threads and the
GIL's switch interval.

Three host hazards sit on a prompt's critical path (the re-tier at a tiered prompt's end runs
about a hundred small host tensor ops and a few Python loops):

- A collection of the oldest generation scans every tracked object, and a served model's
  process holds many from its start-up (modules, kernel caches, CUDA graphs). gc.freeze() after
  start-up moves them to the permanent generation: later collections scan only what requests
  allocate.
- torch runs a host op over more than its grain size (32768 elements) on every intra-op thread,
  and the op ends at a barrier: one worker the OS has descheduled stalls the op for a time
  slice. On a GPU the host's tensors are ids and masks of at most a few hundred thousand
  elements, where one thread is as fast and waits on no other (unless a cold tier gathers
  host rows: `host_compute`).
- A thread that comes back from a call that released the GIL waits for it while another thread
  runs Python, up to the switch interval (5 ms by default) before the holder is made to yield.
  The PD prefill's KV sender thread is such a thread: a Mooncake write releases the GIL for its
  copy, and the scheduler thread launching the next chunk holds it. On two H100s a 256 MiB
  write returns in 0.69 ms alone and in 5.9 ms beside a thread that runs Python without pause
  (benchmarks/pd/mooncake_write.py). A 200 us interval bounds that wait near 0.2 ms.

`settle_scheduler_host` applies all three (env.GC_FREEZE, env.SCHEDULER_THREADS,
env.GIL_SWITCH_US) once the scheduler is built; `GCStats` counts the collections a stretch of work runs into.
"""
from __future__ import annotations

import gc
import logging
import sys
import time

import torch

from sgl_kvxfer import env

logger = logging.getLogger("sgl_kvxfer.host_runtime")


def has_host_compute(scheduler) -> bool:
    """Whether `scheduler` does bulk host tensor work: a cold tier (host-row gathers)."""
    return getattr(getattr(scheduler, "tiering", None), "cold", None) is not None


def _auto_or_count(spec: str | None, auto_value: int | None, var, what: str) -> int | None:
    """`spec` of an "auto or a count >= 0" variable (`var`): auto -> `auto_value`, 0 -> None
    (leave the default), n -> n; anything else is a ValueError naming `var` and `what` it counts."""
    spec = (spec or "auto").strip().lower()
    if spec == "auto":
        return auto_value
    try:
        n = int(spec)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"{var.name} must be auto or {what} >= 0, got {spec!r}")
    return n or None


def scheduler_threads(device: str, spec: str | None, host_compute: bool = False) -> int | None:
    """Intra-op thread count for `spec` (env.SCHEDULER_THREADS) on `device`; None: leave torch's.
    `host_compute`: the scheduler does bulk host tensor work (the cold tier's host-row gathers),
    which `auto` leaves on torch's threads."""
    auto = 1 if str(device).startswith("cuda") and not host_compute else None
    return _auto_or_count(spec, auto, env.SCHEDULER_THREADS, "a thread count")


def gc_freeze_wanted(device: str, spec: str | None) -> bool:
    """Whether to freeze for `spec` (env.GC_FREEZE: auto = on a GPU, 1, 0) on `device`."""
    spec = (spec or "auto").strip().lower()
    if spec == "auto":
        return str(device).startswith("cuda")
    if spec in ("1", "true", "yes", "on"):
        return True
    if spec in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"{env.GC_FREEZE.name} must be auto, 1 or 0, got {spec!r}")


AUTO_GIL_SWITCH_US = 200


def gil_switch_us(device: str, spec: str | None) -> int | None:
    """The GIL switch interval in microseconds for `spec` (env.GIL_SWITCH_US) on `device`; None:
    leave Python's."""
    auto = AUTO_GIL_SWITCH_US if str(device).startswith("cuda") else None
    return _auto_or_count(spec, auto, env.GIL_SWITCH_US, "microseconds")


def settle_scheduler_host(device: str, host_compute: bool = False) -> dict:
    """Cap the intra-op threads, set the GIL switch interval and freeze the start-up objects;
    returns what was applied (torch_threads, gil_switch_us, gc_frozen: the permanent generation's
    size, 0 when not frozen; gil_switch_was_us: the interval before, for release_scheduler_host).
    NOTE: a frozen object is never collected: whoever tears the scheduler down in a process
    that lives on (Engine.shutdown) calls `release_scheduler_host` before its gc.collect()."""
    n = scheduler_threads(device, env.SCHEDULER_THREADS.get(), host_compute)
    if n is not None and n != torch.get_num_threads():
        torch.set_num_threads(n)
    switch_before = round(sys.getswitchinterval() * 1e6)
    us = gil_switch_us(device, env.GIL_SWITCH_US.get())
    if us is not None:
        sys.setswitchinterval(us / 1e6)
    frozen = 0
    if gc_freeze_wanted(device, env.GC_FREEZE.get()):
        gc.collect()  # garbage frozen now would never be freed: collect it first
        gc.freeze()
        frozen = gc.get_freeze_count()
    facts = {"torch_threads": torch.get_num_threads(), "gil_switch_us": round(sys.getswitchinterval() * 1e6),
             "gil_switch_was_us": switch_before, "gc_frozen": frozen}
    logger.info("scheduler host: %s", facts)
    return facts


def release_scheduler_host(facts: dict | None) -> None:
    """Undo the freeze and the switch interval of `settle_scheduler_host` (its `facts`): the
    frozen objects go back to the oldest generation, where a collection can free the torn-down
    scheduler's cycles, and the process's GIL switch interval is what it was."""
    if facts and facts.get("gc_frozen"):
        gc.unfreeze()
    if facts and facts.get("gil_switch_was_us"):
        sys.setswitchinterval(facts["gil_switch_was_us"] / 1e6)


class GCStats:
    """Collections and their time since construction (or the last `reset`), per generation,
    through gc.callbacks. Call `close` when done: the callback runs on every collection."""

    def __init__(self):
        self._start: float | None = None
        self.reset()
        gc.callbacks.append(self._on_gc)

    def reset(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            g = min(max(int(info.get("generation", 2)), 0), 2)
            self.count[g] += 1
            self.seconds[g] += time.perf_counter() - self._start
            self._start = None

    def snapshot(self) -> dict:
        """{"collections": [gen0, gen1, gen2], "ms": [...], "total_ms": ...}."""
        ms = [round(1e3 * s, 3) for s in self.seconds]
        return {"collections": list(self.count), "ms": ms, "total_ms": round(sum(ms), 3)}

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
