"""The prefill role's side CUDA stream for chunk-stream packs.

With overlapped chunks (Scheduler.chunk_overlap) chunk k + 1 is already on the compute stream
when chunk k's pack is launched; on that stream the pack would queue behind k + 1's whole
forward while the link idles. On the side stream the pack waits for chunk k's kernels alone
(an event recorded right behind them at launch) and runs beside k + 1 (a GEMM-bound forward
next to a small memory-bound gather / quantize).

    compute:  [ chunk k ]*[ chunk k+1 .................. ]  J  [ chunk k+2 ...
    side:                 [ pack k | wsum64 | ready ]
              * = after(k), recorded at launch          J = join(): compute waits for side

Invariants (stream safety):
  - Everything a side pack allocates on the device (index tensors, scratch, the checksums and
    their pinned host copy) is allocated while the side stream is current, so the caching
    allocators hand its blocks out again only in the side stream's order. Its inputs from the
    compute stream are the pool and the send buffer, which are never freed. A device tensor a
    pack caches for later use on any stream (wsum64's multipliers) is made by a blocking copy
    and never freed. A send-buffer region is reused only after its write reported, i.e. after
    the sender thread waited for its pack's `ready`.
  - The pool rows a side pack reads are written only by compute-stream kernels: the pack's own
    chunk and those before it (behind `after(k)`), then nothing until the request's rows move or
    are freed and reused. join() orders every compute-stream kernel enqueued after it behind
    every side pack launched before it; the role joins before any of that can happen (the
    prompt's re-tier, a failed or finished room, each poll's end).
  - `ready` (what the sender thread waits for before it reads the bytes) is recorded on the side
    stream after the pack and the checksums, so it completes only once both have run.
Off CUDA there is no stream (create returns None): the role packs in program order.

Which ranges pack on the side stream: every chunk of an untiered pool (the last one too: it
leaves as stored), and every chunk but the last of a tiered chunk stream (the last is packed at
the prompt's final tiers, on the compute stream, ahead of the re-tier's moves). Each carries its
host slot ids from a RowSnapshot taken at its launch, so packing it reads nothing back from a
stream that may hold a later chunk.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch


def leave_legacy_stream(device, spec: str | None) -> bool:
    """Run this thread's CUDA work on a stream of its own instead of the legacy default stream
    (`spec`: env.PD_COMPUTE_STREAM, auto or 0). True when it did.

    Hazard removed: Mooncake's intra-node NVLink transport copies with a synchronous cudaMemcpy,
    which runs on the legacy default stream of the sender thread's device; that stream orders
    against every blocking stream there, torch's default stream among them. With the model on
    the default stream, a chunk's KV write started during the next chunk's forward waits for
    that whole forward (each write took one chunk's compute time). A stream created by torch is
    non-blocking: the copy runs beside the forward.
    NOTE: call it from the thread that runs the model, once the start-up work is queued; it
    waits for the device first, so what start-up made on the default stream is complete."""
    spec = (spec or "auto").strip().lower()
    if spec in ("0", "off", "false", "no") or not str(device).startswith("cuda"):
        return False
    if spec != "auto":
        raise ValueError(f"SGL_KVXFER_PD_COMPUTE_STREAM must be auto or 0, got {spec!r}")
    if torch.cuda.current_stream(device) != torch.cuda.default_stream(device):
        return False  # already off the default stream
    torch.cuda.synchronize(device)
    torch.cuda.set_stream(torch.cuda.Stream(device=device))
    return True


class RowSnapshot:
    """A request row's slot ids copied to the host behind the chunk just launched: an event
    after the copy, not a host wait (a plain `.cpu()` would also wait for every batch launched
    after it). The copy sits in the compute stream ahead of any later launch."""

    def __init__(self, row: torch.Tensor):
        if row.device.type != "cuda":
            self.row, self.ready = row.cpu().clone(), None
            return
        self.row = torch.empty(row.shape, dtype=row.dtype, pin_memory=True)
        self.row.copy_(row, non_blocking=True)
        self.ready = torch.cuda.Event()
        self.ready.record()

    def host(self) -> torch.Tensor:
        """The ids, once the copy is done (waits for the chunk it was taken behind, no later one)."""
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None
        return self.row


class PackStream:
    """A side stream of one CUDA device. `cuda` is torch.cuda (a stand-in in CPU tests)."""

    def __init__(self, device, cuda=torch.cuda):
        self.cuda = cuda
        # high priority: the link waits for the pack, so its few small kernels take SMs ahead
        # of the next chunk's GEMM blocks as those retire (the forward hardly notices)
        self.stream = cuda.Stream(device=device, priority=-1)
        self.dirty = False  # side work launched since the last join

    @classmethod
    def create(cls, device) -> "PackStream | None":
        return cls(device) if str(device).startswith("cuda") else None

    def mark(self):
        """An event recorded on the current (compute) stream, right behind what is queued on it."""
        ev = self.cuda.Event()
        ev.record()
        return ev

    @contextmanager
    def after(self, event):
        """Run the block's device work on the side stream, after `event` (a mark()) completes."""
        self.stream.wait_event(event)
        self.dirty = True  # (also when the block raises: some of its work may be queued)
        with self.cuda.stream(self.stream):
            yield self.stream

    def join(self) -> None:
        """The compute stream waits (on the device; the host does not) for all side work so far."""
        if self.dirty:
            self.cuda.current_stream().wait_stream(self.stream)
            self.dirty = False
