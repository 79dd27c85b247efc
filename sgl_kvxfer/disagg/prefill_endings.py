"""How a prefill room ends: aborts, a dead decode, deadlines, failure and finish (mixed into
PrefillRole, prefill.py).

Invariants:
- A failed room is remembered in `ended` for --kv-transfer-timeout: a late register or claim
  for it gets KVFailed. Its queued writes are cancelled before they start.
- A room finishes (the request retires, its KV goes to the radix cache) only once no write is
  in flight: those writes still read the send buffer.
"""
from __future__ import annotations

import logging
import time

from sgl_kvxfer.disagg.base import KVPoll
from sgl_kvxfer.disagg.peers import endpoint_peer
from sgl_kvxfer.disagg.prefill_room import PrefillRoom
from sgl_kvxfer.disagg.sender import NoticeJob
from sgl_kvxfer.message.disagg import KVFailed

logger = logging.getLogger(__name__)


class PrefillEndings:
    """PrefillRole's room endings; reads the role's rooms, settings, stats and sender."""

    def abort(self, rid: str, abort_all: bool) -> None:
        """A request waiting here ends as aborted; one still prefilling is the scheduler's to
        end (its room just closes)."""
        for room in list(self.rooms.values()):
            req = room.req
            if req is None or not (abort_all or req.rid == rid):
                continue
            if room.prompt_done:
                req.finish({"type": "abort", "message": "Abort requested", "status_code": None, "err_type": None})
                self._fail(room, "aborted")
            else:
                room.req = None
                self._fail(room, "aborted")

    def _decode_of(self, room) -> str | None:
        """The decode a live room depends on (None: none registered yet, or the room failed)."""
        # NOTE: an SCD room (scd_prefill.py) has consumers, not one decode: not watched here
        decode = getattr(room, "decode", None)
        return decode if decode and room.error is None else None

    def watched_peers(self) -> dict:
        """The KV inboxes of decodes that registered for or claimed open rooms."""
        return {endpoint_peer(d): d for d in map(self._decode_of, self.rooms.values()) if d}

    def on_peer_dead(self, peer, reason: str) -> None:
        """A decode that registered for rooms and died: its rooms end now, naming it."""
        for room in [r for r in self.rooms.values() if (d := self._decode_of(r)) and endpoint_peer(d) == peer]:
            room.claim = None  # nothing more goes to it
            self._fail(room, reason)

    def _check_deadline(self, room: PrefillRoom, now: float) -> None:
        if room.error or room.state == KVPoll.SUCCESS or room.done_queued:
            return
        deadline = self.settings.claim_deadline_s
        if room.decode is None and room.req is not None and now - room.created > deadline:
            self._fail(room, f"decode unreachable: no decode registered for the room within {deadline:g} s of "
                             "the request's arrival (the decode died or never got the request)")
        elif now - room.progress > self.settings.timeout_s:
            if room.req is None:  # an orphan claim: its request never came
                self._fail(room, "no request for the room")
            elif room.claim is None:
                self._fail(room, "no decode claimed the room")
            elif room.prompt_done:
                self._fail(room, "transfer stalled")

    def _fail(self, room: PrefillRoom, reason: str) -> None:
        self._join_packs()  # the scheduler may free the request's KV next (an abort)
        if room.error is None:
            room.error = reason
            room.state = KVPoll.FAILED
            self.ended[room.room] = (reason, time.monotonic() + self.settings.timeout_s)
            self.sender.cancelled.add(room.room)  # its queued writes must not start
            self.stats.outcome("failed:" + reason.split(":")[0])
            logger.warning("PD room %d failed: %s", room.room, reason)
            if room.claim is not None:
                self.sender.submit(NoticeJob(room.room, room.claim.reply_to, KVFailed(room.room, reason)))
        if room.req is None:  # nothing was packed for it
            self.rooms.pop(room.room, None)
            self.sender.cancelled.discard(room.room)
        elif room.prompt_done or room.req.finished:
            self._finish(room)

    def _finish(self, room: PrefillRoom) -> None:
        """End the request: its HTTP reply completes and its KV goes to the radix cache."""
        if room.inflight or room.finished:  # writes still read the send buffer: finish when they report
            return
        room.finished = True
        self.rooms.pop(room.room, None)
        self.sender.cancelled.discard(room.room)
        req = room.req
        if req.finished_reason is None:
            req.finish({"type": "length", "length": len(req.output_ids)})
        req.extra_meta = {"kv_transfer": {"status": "ok" if room.error is None else "failed: " + room.error,
                                          "bytes": room.wire_bytes,
                                          "bytes_per_token": room.wire_bytes / max(1, len(req.origin_input_ids)),
                                          "transfer_ms": 1e3 * (time.monotonic() - (room.first_write or time.monotonic()))}}
        if room.trace is not None:
            req.extra_meta["kv_transfer"]["trace"] = room.trace.spans
        self._join_packs()  # (its packs have all run: the sender waited for each `ready`)
        self.ctx.retire(req)
