"""How a decode room fails: everything it holds is freed and the request is prefilled locally,
or rejected for a misconfigured pair (mixed into DecodeRole, decode.py).

Invariants:
- A claimed region a live prefill knows is quarantined for --kv-transfer-timeout, not freed: a
  prefill that has not seen the cancel may still write into it.
- A room leaves `rooms` exactly once (`_release_room`); its route lookup is cancelled.
"""
from __future__ import annotations

import logging
import time

from sgl_kvxfer.disagg.decode_room import DecodeRoom
from sgl_kvxfer.message.disagg import KVCancel

logger = logging.getLogger(__name__)


class DecodeFallback:
    """DecodeRole's room failure; reads the role's kv, regions, monitor and scheduler context."""

    def _end(self, room: DecodeRoom, reason: str, fallback: bool = True, notify: bool = True) -> None:
        """Fail the room: free what it holds; the request is prefilled here (or was aborted)."""
        logger.warning("PD room %d: %s%s", room.room, reason, "; prefilling locally" if fallback else "")
        self.routes.pop(self._peer(room.req.bootstrap), None)  # ask that prefill afresh next time
        if notify and room.endpoint and room.region is not None:
            self._push(room.endpoint, KVCancel(room.room, self.decode_id, reason))
        req = room.req
        self.kv.release(req)
        req.output_ids.clear()
        if room.region is not None and room.claimed_at:  # the prefill knows this region
            if self.monitor.is_dead(self._peer(room.req.bootstrap)):  # a dead prefill writes nothing late
                self.regions.free(room.region)
            else:
                self.quarantine.append((time.monotonic() + self.settings.timeout_s, room.region))
            room.region = None
        self._release_room(room)
        if fallback:
            self.stats.outcome("fallback:" + reason.split(":")[0].split(" in ")[0])
            req.extra_meta = {"kv_transfer": {"status": "fallback: " + reason}}
            self.ctx.requeue(req)

    def _reject(self, room: DecodeRoom, reason: str) -> None:
        """A prefill this server cannot take KV from (not a transfer fault): the request fails
        with 400 and the reason; no local prefill hides a misconfigured pair."""
        req = room.req
        self._end(room, reason, fallback=False)
        self.stats.outcome("rejected")
        req.finish({"type": "abort", "message": reason, "status_code": 400, "err_type": "BadRequestError"})
        self.ctx.retire(req)

    def _release_room(self, room: DecodeRoom) -> None:
        self.rooms.pop(room.room, None)
        if room.region is not None:
            self.regions.free(room.region)
            room.region = None
        if room.route is not None:
            room.route.cancel()
