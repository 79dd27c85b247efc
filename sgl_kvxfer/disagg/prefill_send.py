"""The prefill role's send path: decode messages in, ranges packed into the send buffer, writes
and the KVDone notice out to the sender thread, its results back (mixed into PrefillRole,
prefill.py).

Invariants:
- A range is packed only once the decode's ring has room for it (RingWriter.place) and the send
  buffer has a region; otherwise it stays pending and the next poll retries.
- Nothing here waits for a pack: the sender thread waits for each write's `ready` event.
- KVDone is queued only after the prompt is done, nothing is pending and every write reported.
"""
from __future__ import annotations

import time
from contextlib import nullcontext

import torch

from sgl_kvxfer.disagg.base import KVPoll
from sgl_kvxfer.disagg.buffers import wsum64_async
from sgl_kvxfer.disagg.prefill_room import TIER_KEEP, PrefillRoom, _Range
from sgl_kvxfer.disagg.sender import NoticeJob, WriteJob
from sgl_kvxfer.disagg.staging import RingWriter
from sgl_kvxfer.mem_cache.kv_payload import pack_segment, segment_layout, tier_counts, wire_tier_of
from sgl_kvxfer.message.disagg import KVAck, KVCancel, KVClaim, KVDone, KVFailed, KVRegister, KVSegment
from sgl_kvxfer.spectrum.tiers import TIER_DROP, TIER_INT8


class PrefillSender:
    """PrefillRole's messages, results and packing; reads the role's rooms, buffers and sender."""

    def _on_message(self, msg) -> None:
        room = self.rooms.get(msg.room)
        if isinstance(msg, (KVRegister, KVClaim)):
            failed = room.error if room is not None else self.ended.get(msg.room, ("",))[0]
            if failed:  # late for a room that failed here: the decode prefills locally now
                self.sender.submit(NoticeJob(msg.room, msg.decode_id, KVFailed(msg.room, failed)))
                return
        if isinstance(msg, KVRegister):
            if room is None:  # the decode came first: the request follows (or the room orphans)
                room = self.rooms[msg.room] = PrefillRoom(msg.room)
            room.decode, room.progress = room.decode or msg.decode_id, time.monotonic()
        elif isinstance(msg, KVClaim):
            if msg.layout != self.layout:
                self.sender.submit(NoticeJob(msg.room, msg.reply_to, KVFailed(
                    msg.room, f"incompatible KV layout: prefill {self.layout}, decode {msg.layout}")))
                return
            if room is None:  # the claim came first: the request follows (or the room orphans)
                room = self.rooms[msg.room] = PrefillRoom(msg.room)
            room.claim, room.ring, room.progress = msg, RingWriter(msg.region_bytes), time.monotonic()
            room.decode = msg.reply_to
            if room.prompt_done and room.state == KVPoll.BOOTSTRAPPING:
                room.state = KVPoll.TRANSFERRING
            elif room.state == KVPoll.BOOTSTRAPPING:
                room.state = KVPoll.WAITING_FOR_INPUT
        elif room is None or room.claim is None or msg.decode_id != room.claim.decode_id:
            return  # a late message for a room that ended, or from a decode it no longer serves
        elif isinstance(msg, KVAck):
            room.ring.ack(msg.seq)
            room.progress = time.monotonic()
        elif isinstance(msg, KVCancel):
            room.claim = None  # nothing more goes to that decode
            self._fail(room, f"cancelled by decode: {msg.reason}")

    def _on_result(self, res) -> None:
        room = self.rooms.get(res.room)
        if room is None:
            return
        off = room.inflight.pop(res.seq, None)
        if off is not None:
            self.send_alloc.free(off)
        room.progress = time.monotonic()
        if res.error:
            self._fail(room, f"write failed: {res.error}")
        elif res.seq >= 0:
            room.wire_bytes += res.nbytes
            room.wire_seconds += res.write_seconds
            self.stats.moved(res.nbytes)
            if room.trace is not None:
                if res.ready_wait is not None:  # the sender waiting for the pack's kernels
                    room.trace.add(f"pack_wait[{res.seq}]", *res.ready_wait)
                room.trace.add(f"wire[{res.seq}]", res.write_start, res.write_end)
        elif room.done_queued and room.error is None:  # KVDone is out
            room.state = KVPoll.SUCCESS
            self.stats.outcome("ok")
            self._finish(room)
        if room.error is not None and room.req is not None and (room.prompt_done or room.req.finished):
            self._finish(room)  # a failed room's last write reported

    def _pump(self, room: PrefillRoom) -> None:
        if room.claim is None or room.error or room.state == KVPoll.SUCCESS:
            return
        while room.pending:
            if not self._send_next(room):
                return
        if room.prompt_done and not room.inflight and not room.done_queued:
            self._queue_done(room)

    def _segment_tiers(self, room: PrefillRoom, rng: _Range, slots: torch.Tensor) -> torch.Tensor:
        """Wire tier per position of the range (int16: TIER_KEEP does not fit int8; on the wire
        one unsigned byte each)."""
        if rng.kind == "chunk":
            return rng.tiers.to(torch.int16)
        stored = wire_tier_of(self.pool, slots).to(torch.int16)
        if rng.kind == "int8":
            return torch.where(stored == TIER_DROP, stored, torch.full_like(stored, TIER_INT8))
        if rng.kind == "replace":  # what the int8 stream got right stays where it is
            return torch.where(stored == TIER_INT8, torch.full_like(stored, TIER_KEEP), stored)
        if rng.kind == "upgrade":  # a smaller tier id is more precise: resend those, keep the rest
            sent = room.sent_tiers[rng.start:rng.end]
            return torch.where(stored < sent, stored, torch.full_like(stored, TIER_KEEP))
        return stored

    def _send_next(self, room: PrefillRoom) -> bool:
        """Pack the next pending range (split to fit the decode's ring) and queue its write."""
        rng = room.pending[0]
        req = room.req
        t0 = time.time()
        # the range's slot ids on the host: the one read-back of a pack (tiers, the live cut
        # and pack_segment's routing below all run on these, with no further host sync)
        slots = rng.slots if rng.slots is not None else self.table.read(req.req_pool_idx, rng.end, start=rng.start).cpu()
        tiers = self._segment_tiers(room, rng, slots)
        if rng.kind == "upgrade" and bool((tiers == TIER_KEEP).all()):
            room.pending.popleft()  # no token's tier rose: nothing to resend
            return True
        live = (tiers != TIER_DROP) & (tiers != TIER_KEEP)
        lay = segment_layout(self.pool, tier_counts(tiers[live]))
        if not room.ring.fits_ever(lay.total_bytes) or lay.total_bytes > self.send_alloc.total // 2:
            if rng.end - rng.start == 1:
                self._fail(room, f"one token's KV ({lay.total_bytes} B) exceeds the transfer buffers")
                return False
            room.pending.popleft()
            room.pending.extendleft(reversed(rng.split()))
            return True
        seq = room.next_seq
        dst = room.ring.place(seq, lay.total_bytes)
        if dst is None:
            return False  # the decode has not acked enough yet
        src = self.send_alloc.alloc(lay.total_bytes)
        if src is None:
            room.ring.ack(seq)  # undo the placement; retry next poll
            return False
        payload = self.buffer[src:src + lay.total_bytes]
        # nothing here waits for the pack: on CUDA the sender thread waits for `ready` (recorded
        # after the pack and, for a device buffer, the checksums summed where the bytes are, on
        # the stream that ran them) before it reads the bytes; a host buffer gets its xxh3 there.
        # A chunk's own range packs on the side stream after that chunk's kernels (pack_stream.py)
        side = self.packs is not None and rng.after is not None
        with self.packs.after(rng.after) if side else nullcontext():
            pack_segment(self.pool, slots[live], tiers[live], payload)
            ready, host_sums = None, None
            if self.buffer.on_device:
                host_sums, ready = wsum64_async(payload)
            elif torch.cuda.is_available():
                ready = torch.cuda.Event()
                ready.record()
        if rng.kind == "chunk":
            if room.sent_tiers is None:
                room.sent_tiers = torch.full((len(req.origin_input_ids),), -1, dtype=torch.int16)
            room.sent_tiers[rng.start:rng.end] = tiers
        segment = KVSegment(room.room, seq, rng.start, rng.end, None if bool((tiers == 0).all()) else tiers.to(torch.uint8).numpy().tobytes(),
                            lay.lens, dst, lay.total_bytes, 0, [], replaces=rng.kind in ("replace", "upgrade"))
        room.inflight[seq] = src
        room.next_seq += 1
        room.pending.popleft()
        room.first_write = room.first_write or time.monotonic()
        if room.trace is not None:
            room.trace.add(f"pack[{seq}]", t0)
        c = room.claim
        self.sender.submit(WriteJob(room.room, seq, payload, c.session, c.region_addr + dst, c.reply_to, segment,
                                    None, self.buffer.checksum_kind if self.buffer.on_device else "xxh3",
                                    ready, host_sums))
        return True

    def _queue_done(self, room: PrefillRoom) -> None:
        req = room.req
        msg = KVDone(room.room, room.next_seq, req.output_ids[0], req.cached_tokens, room.wire_bytes,
                     wire_seconds=room.wire_seconds, tail_seconds=time.monotonic() - room.prompt_done_at)
        if req.return_logprob and req.output_token_logprobs:
            msg.output_token_logprob = req.output_token_logprobs[0]
            msg.output_top_logprobs = req.output_top_logprobs[:1] or None
            msg.output_token_ids_logprobs = req.output_token_ids_logprobs[:1] or None
        room.done_queued = True
        self.stats.tokens += len(req.origin_input_ids)
        if room.trace is not None:
            room.trace.add("notice", time.time())
            pauses = getattr(self, "gc_pauses", None)
            if pauses is not None:
                room.trace.spans.extend(pauses.spans(room.trace.start_of("arrival") or 0.0, time.time()))
            msg.trace = room.trace.spans
        self.sender.submit(NoticeJob(room.room, room.claim.reply_to, msg))
