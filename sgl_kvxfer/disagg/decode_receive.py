"""The decode role's segment receive: messages from the prefill, each segment's checksums
launched (PendingChecksums) then its unpack, sums compared without a host wait, acks (mixed into
DecodeRole, decode.py).

Invariants:
- A segment's sums are launched once, before its unpack, and compared only when their event is
  done; a mismatch ends the room before any decode step reads the KV.
- A segment is acked only after its sums matched and its unpack kernels finished: only then may
  the prefill reuse its ring bytes.
"""
from __future__ import annotations

import time

import torch

from sgl_kvxfer.disagg.base import KVPoll
from sgl_kvxfer.disagg.buffers import PendingChecksums
from sgl_kvxfer.disagg.decode_room import DecodeRoom
from sgl_kvxfer.message.disagg import KVAck, KVDone, KVFailed, KVSegment


class DecodeReceive:
    """DecodeRole's receive and verify steps; reads the role's staging, stats and peers."""

    def _on_message(self, room: DecodeRoom, msg) -> None:
        room.progress = time.monotonic()
        if isinstance(msg, KVSegment):
            room.segments[msg.seq] = msg
            room.state = KVPoll.TRANSFERRING
        elif isinstance(msg, KVDone):
            room.done, room.state = msg, KVPoll.TRANSFERRING
        elif isinstance(msg, KVFailed):
            self._end(room, "prefill failed: " + msg.reason, notify=False)

    def _unpack_ready(self, room: DecodeRoom) -> None:
        """Launch each arrived segment's checksums, then its unpack, in seq order.
        NOTE: a segment is unpacked before its sums are read. Its KV is in slots of a request
        no decode step sees until `_succeed` (every sum compared first); a mismatch ends the
        room (`_verify`), which frees those slots. Kernels still queued on them run before any
        kernel of a later owner (one stream)."""
        while room.unpacked in room.segments:
            seg = room.segments[room.unpacked]
            t0 = time.time()
            payload = self.staging[room.region + seg.offset:room.region + seg.offset + seg.nbytes]
            if seg.seq not in room.unverified:  # launched once: a retry (no KV room) reuses it
                room.unverified[seg.seq] = (PendingChecksums(payload, seg.checksum_kind, seg.block_bytes),
                                            seg.checksums)
            if not self._write_segment(room.req, seg, payload):
                return  # no KV room yet (retried next poll; the prefill waits for the ack), or failed
            del room.segments[room.unpacked]
            room.unpacked += 1
            room.wire_bytes += seg.nbytes
            self.stats.moved(seg.nbytes)
            event = None
            if self.staging.on_device:  # NOTE: the unpack kernels still read the staging bytes
                event = torch.cuda.Event()
                event.record()
            room.acks.append((seg.seq, event))  # host staging: copied out of host memory already
            if room.trace is not None:
                room.trace.add(f"unpack[{seg.seq}]", t0)

    def _verify(self, room: DecodeRoom) -> bool:
        """Compare the sums whose event is done, in seq order (no wait). False: a mismatch
        ended the room (the request is prefilled here; nothing it received is read)."""
        while room.unverified:
            seq, (pending, want) = next(iter(room.unverified.items()))
            if not pending.ready():
                return True
            bad = pending.first_bad(want)
            if bad is not None:
                self._end(room, f"checksum mismatch in segment {seq} block {bad}")
                return False
            del room.unverified[seq]
        return True

    def _wait_room(self, room: DecodeRoom) -> None:
        """Every segment is in: wait for its sums, then its unpack kernels, each a trace span.
        The sums' events precede the unpack's on the stream, so the second wait is the rest."""
        if room.unverified:
            t0 = time.time()
            next(reversed(room.unverified.values()))[0].wait()
            if room.trace is not None:
                room.trace.add("checksum_wait", t0)
        if room.acks and room.acks[-1][1] is not None:
            t0 = time.time()
            room.acks[-1][1].synchronize()
            if room.trace is not None:
                room.trace.add("unpack_wait", t0)

    def _ack_unpacked(self, room: DecodeRoom) -> None:
        """Ack segments whose sums matched and whose unpack kernels are done: only then may the
        prefill write over their ring bytes (and the room's region go back, at success)."""
        while room.acks and room.acks[0][0] not in room.unverified and \
                (room.acks[0][1] is None or room.acks[0][1].query()):
            self._push(room.endpoint, KVAck(room.room, self.decode_id, room.acks.popleft()[0]))
