"""The per-request PD phase trace (`--enable-pd-trace`): where a request's time to first token goes.

Each server records spans (name, start, end) in wall-clock seconds (`time.time()`, so the
prefill's spans and the decode's share one clock when both run on one host; across hosts they
are as close as the hosts' clocks). The prefill sends its spans with KVDone; the decode renders
both sides into its reply's `meta_info.kv_transfer.trace`:

    prefill  queue          arrival -> its first chunk is launched
             prefill[a:b]   one chunk's forward, positions [a, b): from its own launch (with
                            overlapped prefill the next chunk launches before this one's span
                            is closed) to an event recorded behind its kernels (a GPU chunk
                            ends when they do; a chunk launched after it is not waited for)
             chunk_tier[a:b]  tiers chosen for a streamed chunk (`--kv-transfer-stream chunk`)
             tier           the last chunk's end -> the prompt is tiered and cached; within it
                            (b < 1) tier_scores (the importance read back to the host),
                            tier_retier (tiers assigned, KV moved to the int stores; its
                            parts tier_assign: the byte-budget search, tier_move: ids planned
                            and the moves launched, tier_row: the row rewritten, queued
                            behind the moves without a host wait),
                            tier_retier_cpu (the scheduler thread's CPU time in tier_retier,
                            drawn from its start: far below tier_retier, the thread waited),
                            tier_evict (the retier's summed radix evictions for int-store room,
                            drawn from its start) and cache (the prompt into the radix cache)
             pack[s]        segment s: the gather-pack and checksum launched (on CPU: done)
             pack_wait[s]   segment s, CUDA: the sender thread waiting for those kernels
             wire[s]        segment s: the engine's write
             notice         KVDone on its way
             gc             a pause of Python's garbage collector over 1 ms while the room
                            was open (any generation: `gc<g>` in the span list)
    decode   bootstrap      arrival -> the claim is sent (bootstrap lookup, staging, request row)
             unpack[s]      segment s: checksum verified, slots allocated, unpack launched
             unpack_wait    GPU staging: the last unpack's kernels finishing (its acks wait on them)
             admit          KVDone handled -> the first token is queued to the client
             emit           streamed replies: the first token queued -> its chunk written on the
                            decode's HTTP stream (detokenizer and HTTP-server hops; not in critical_ms)
             first_step     the request's first decode step (after the first token is queued; it
                            runs once the scheduler's loop has sent that token out)

`critical_ms` runs from the earlier arrival to the first token queued in the decode's scheduler;
`unaccounted_ms` is the part of it no span covers (message hops, loop wake-ups, ...), and `gaps`
lists each uncovered stretch over 1 ms with the spans around it. `first_token_time` is when the
first token was queued (time.time() seconds), which d.emit is measured from. What a client sees
beyond critical_ms + d.emit is its own path: the router's hops (it relays the decode's stream only
once the prefill's reply has ended) and the wire.
"""
from __future__ import annotations

import gc
import time
from collections import deque


class PhaseTrace:
    """Spans of one request on one server; cheap enough to keep for every traced request."""

    def __init__(self):
        self.spans: list[list] = []  # [name, start, end] in time.time() seconds

    def add(self, name: str, start: float, end: float | None = None) -> None:
        self.spans.append([name, start, time.time() if end is None else end])

    def start_of(self, name: str) -> float | None:
        return next((s for n, s, _ in self.spans if n == name), None)


class GCPauses:
    """The process's garbage-collector pauses (gc.callbacks), the latest `keep`, for the trace: a
    collection of the oldest generation in a server process can take tens of ms."""

    def __init__(self, keep: int = 256, min_s: float = 1e-3):
        self.pauses: deque = deque(maxlen=keep)  # (generation, start, end) in time.time() seconds
        self.min_s = min_s
        self._start: float | None = None
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.time()
        elif self._start is not None:
            end = time.time()
            if end - self._start > self.min_s:
                self.pauses.append((info.get("generation", -1), self._start, end))
            self._start = None

    def spans(self, t0: float, t1: float) -> list[list]:
        """Pauses overlapping [t0, t1] as trace spans [f"gc{generation}", start, end]."""
        return [[f"gc{g}", s, e] for g, s, e in list(self.pauses) if e > t0 and s < t1]

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)


def _gaps(spans: list[list], t0: float, t1: float, min_gap: float = 1e-3) -> tuple[float, list]:
    """Uncovered time of [t0, t1] by the union of spans, and the stretches over min_gap."""
    covered_to, last, total, gaps = t0, "arrival", 0.0, []
    for name, s, e in sorted(spans, key=lambda x: x[1]):
        s, e = max(s, t0), min(e, t1)
        if e <= covered_to:
            continue
        if s > covered_to:
            total += s - covered_to
            if s - covered_to > min_gap:
                gaps.append([last, name, round(1e3 * (s - covered_to), 3)])
        covered_to, last = max(covered_to, e), name
    if t1 > covered_to:
        total += t1 - covered_to
        if t1 - covered_to > min_gap:
            gaps.append([last, "first token", round(1e3 * (t1 - covered_to), 3)])
    return total, gaps


def render(prefill: list[list], decode: list[list], arrivals: list[float], first_token: float) -> dict:
    """The reply's trace: every span as [side.name, start_ms, dur_ms] from the earlier arrival,
    summed time per phase kind, the critical path and its uncovered stretches."""
    t0 = min(arrivals)
    spans = [["p." + n, s, e] for n, s, e in prefill] + [["d." + n, s, e] for n, s, e in decode]
    spans.sort(key=lambda x: x[1])
    by_kind: dict[str, float] = {}
    for name, s, e in spans:
        kind = name.split("[")[0]
        by_kind[kind] = by_kind.get(kind, 0.0) + 1e3 * (e - s)
    unaccounted, gaps = _gaps(spans, t0, first_token)
    return {"phases": [[n, round(1e3 * (s - t0), 3), round(1e3 * (e - s), 3)] for n, s, e in spans],
            "by_phase_ms": {k: round(v, 3) for k, v in by_kind.items()},
            "critical_ms": round(1e3 * (first_token - t0), 3), "unaccounted_ms": round(1e3 * unaccounted, 3),
            "gaps": gaps, "first_token_time": first_token}


def with_emit(snapshot: dict, written_at: float) -> dict:
    """`snapshot` (a streamed reply's, after its first chunk was written at `written_at`) with
    the d.emit span in its PD trace; unchanged when it carries no trace or has the span. The
    snapshot's meta dicts are shared with the request's state: copied, never changed in place."""
    meta = snapshot.get("meta_info")
    kv = meta.get("kv_transfer") if isinstance(meta, dict) else None
    trace = kv.get("trace") if isinstance(kv, dict) else None
    if not isinstance(trace, dict) or "first_token_time" not in trace:
        return snapshot
    phases = trace.get("phases", [])
    if any(p[0] == "d.emit" for p in phases):
        return snapshot
    emit = ["d.emit", trace["critical_ms"], round(1e3 * (written_at - trace["first_token_time"]), 3)]
    trace = {**trace, "phases": [*phases, emit], "by_phase_ms": {**trace.get("by_phase_ms", {}), "d.emit": emit[2]}}
    return {**snapshot, "meta_info": {**meta, "kv_transfer": {**kv, "trace": trace}}}
