"""The decode role's unpack and admission: a segment's slots allocated per tier and written into
the request's row, then the request made ready to join the running batch (mixed into DecodeRole,
decode.py).

Invariants:
- A row's positions are written in order from 0 (a replacing segment rewrites positions already
  held); `req.kv_len` covers exactly the positions that hold slots.
- Tiered pool: each tier's positions are allocated in position order, one call per tier (the
  int stores' prefix-fill invariant, mem_cache/tiered_allocator.py).
"""
from __future__ import annotations

import time

import numpy as np
import torch

from sgl_kvxfer.disagg.decode_room import DecodeRoom
from sgl_kvxfer.disagg.prefill_room import TIER_KEEP
from sgl_kvxfer.disagg.trace import PhaseTrace, render
from sgl_kvxfer.mem_cache.kv_payload import unpack_segment
from sgl_kvxfer.message.disagg import KVSegment
from sgl_kvxfer.spectrum.tiers import TIER_DROP, TIER_FP16, TIER_INT4, TIER_INT8


def _timed_evictions(fn, spent: list[float], tree):
    """fn (a make_room), adding to spent[0] the host time of each call that evicted cache
    leaves (the radix tree's evictable size fell; a call that only found room adds nothing)."""
    def call(*args):
        t, before = time.time(), tree.evictable_size() if tree is not None else 0
        try:
            return fn(*args)
        finally:
            if tree is not None and tree.evictable_size() < before:
                spent[0] += time.time() - t
    return call


class DecodeUnpack:
    """DecodeRole's unpack and admit steps; reads the role's pool, table, kv and stats."""

    def _write_segment(self, req, seg: KVSegment, payload: torch.Tensor) -> bool:
        """Allocate slots for the segment's positions, unpack, update the row. False: no room."""
        n = seg.end - seg.start
        tiers = torch.zeros(n, dtype=torch.int16) if seg.tiers is None else \
            torch.from_numpy(np.frombuffer(seg.tiers, dtype=np.uint8).astype(np.int16))
        if bool((tiers == TIER_DROP).any()) and not self.pool.drops_tokens:
            self._end(self.rooms[req.bootstrap.room], "the payload drops tokens; a decode pool that masks "
                      "dropped tokens is tiered (--kv-tier-budget < 1)")
            return False
        if not seg.replaces and seg.start != req.kv_len:
            # the row's positions must be written in order from 0: a hole would be decoded
            # from whatever slot ids the row held before (and freed twice by release)
            self._end(self.rooms[req.bootstrap.room],
                      f"KV for positions [{seg.start}, {seg.end}) does not continue [0, {req.kv_len})")
            return False
        change = tiers != TIER_KEEP
        row = req.req_pool_idx
        room = self.rooms.get(req.bootstrap.room)
        trace = room.trace if room is not None else None
        evict_s = [0.0]  # summed host time of the evictions this segment makes (alloc and repack)
        t0 = time.time()
        old = self.table.read(row, seg.end, start=seg.start).clone()
        new = self._alloc_positions(req, seg, tiers, change, evict_s)
        if new is None:
            return False
        t1 = time.time()
        if seg.tiers is None:  # every position at the model dtype, none kept or dropped
            by_tier, row_slots = (new, new[:0], new[:0]), new.to(old.device)
        else:
            # each tier's positions picked on the host, gathered by index on the device: a
            # boolean mask over device ids would read them back (a host wait behind queued steps)
            live = change & (tiers != TIER_DROP)
            by_tier = tuple(new[(live & (tiers == t)).nonzero().squeeze(1).to(new.device)]
                            for t in (TIER_FP16, TIER_INT8, TIER_INT4))
            row_slots = torch.where(change.to(old.device), new.to(old.device), old)
        unpack_segment(self.pool, payload, seg.lens, by_tier)
        t2 = time.time()
        self.table.write(row, seg.start, row_slots)
        req.kv_len = max(req.kv_len, seg.end)  # positions [0, kv_len) hold slots (release frees them)
        if seg.replaces and self.tiered:  # the streamed int8 copies of replaced tokens
            self.kv.allocator.free(old[change.to(old.device) & (old != 0)])
            # what stays of a streamed int8 page may now start past its slot 0: relocate it
            # (prefix-fill invariant, mem_cache/tiered_allocator.py)
            make_room = _timed_evictions(self.kv.make_room_tier, evict_s, self.kv.tree)
            self.table.write(row, seg.start, self.kv.allocator.repack(row_slots, make_room))
        if trace is not None:  # parts of unpack[s] (decode_receive.py); evict drawn from alloc's start
            trace.add(f"unpack_alloc[{seg.seq}]", t0, t1)
            if evict_s[0] > 0:
                trace.add(f"unpack_evict[{seg.seq}]", t0, t0 + evict_s[0])
            trace.add(f"unpack_write[{seg.seq}]", t1, t2)
            trace.add(f"unpack_row[{seg.seq}]", t2)
        return True

    def _alloc_positions(self, req, seg, tiers, change, evict_s: list[float]) -> torch.Tensor | None:
        """New slot per changed position (0 for a drop); None when the pool has no room.
        Tiered pool: each tier's positions in position order, one alloc_tier call per tier (the
        int stores fill fresh pages in that order: the prefix-fill invariant); a short store
        first evicts cache leaves for its pages, and what it still lacks lands in fp16.
        evict_s[0] gains the host time of the calls that evicted."""
        n = seg.end - seg.start
        out = torch.zeros(n, dtype=torch.int64, device=self.table.table.device)
        if not self.tiered:
            if seg.replaces:  # overwrite in place: same slots, new values
                return self.table.read(req.req_pool_idx, seg.end, start=seg.start).clone()
            slots = self.kv.alloc([req], [n], [seg.start])
            return slots
        alloc = self.kv.allocator
        tree = self.kv.tree
        make_room = _timed_evictions(self.kv.make_room, evict_s, tree)
        make_room_tier = _timed_evictions(self.kv.make_room_tier, evict_s, tree)
        for t in (TIER_FP16, TIER_INT8, TIER_INT4):
            idx = (change & (tiers == t)).nonzero().squeeze(1)
            if not idx.numel():
                continue
            if t == TIER_FP16:
                if not make_room(idx.numel()):
                    alloc.free(out[out != 0])
                    return None
                got = alloc.alloc(idx.numel())
            else:
                # a store full of cached pages gives its pages back first (as the re-tier's
                # make_room does): tokens it cannot take land in fp16 dequantized, which sends
                # the whole segment's unpack down the per-layer path (kv_payload.unpack_segment)
                missing = idx.numel() - alloc.available_tier(t)
                if missing > 0:
                    make_room_tier(t, missing)
                got = alloc.alloc_tier(t, idx.numel())
                short = idx.numel() - got.numel()
                if short and make_room(short):  # the rest lands in fp16 (dequantized)
                    got = torch.cat([got, alloc.alloc(short)])
                if got.numel() < idx.numel():
                    alloc.free(torch.cat([out[out != 0], got]))
                    return None
            out[idx.to(out.device)] = got.to(out.device)
        return out

    def _succeed(self, room: DecodeRoom) -> None:
        req, done = room.req, room.done
        n = len(req.origin_input_ids)
        if req.kv_len != n:
            self._end(room, f"the prefill's KV covered {req.kv_len} of the prompt's {n} positions")
            return
        req.output_ids.append(done.first_token)
        req.cached_tokens = done.cached_tokens
        if req.return_logprob and done.output_token_logprob is not None:
            req.output_token_logprobs.append(done.output_token_logprob)
            req.output_top_logprobs.extend(done.output_top_logprobs or [])
            req.output_token_ids_logprobs.extend(done.output_token_ids_logprobs or [])
        seconds = time.monotonic() - room.claimed_at
        req.extra_meta = {"kv_transfer": {
            "status": "ok", "bytes": room.wire_bytes, "bytes_per_token": room.wire_bytes / n, "segments": room.unpacked,
            "transfer_ms": 1e3 * seconds,  # claim -> every segment unpacked (includes the prefill's compute)
            "wire_ms": 1e3 * done.wire_seconds,  # the link's busy time for this room
            "tail_ms": 1e3 * done.tail_seconds,  # prompt done -> last write: what the prefill did not hide
            "link_gbps": room.wire_bytes * 8 / done.wire_seconds / 1e9 if done.wire_seconds else 0.0}}
        self.stats.outcome("ok")
        self.stats.tokens += n
        self._release_room(room)
        if room.trace is not None:
            room.trace.add("done", time.time(), time.time())
            self.traces[req] = (done.trace or [], room.trace)
        self.ready.append(req)

    def _close_trace(self, req, prefill: list, trace: PhaseTrace) -> None:
        """Render the trace into the reply: the first token is queued now."""
        now = time.time()
        trace.add("admit", trace.start_of("done"), now)
        arrivals = [t for t in (trace.start_of("arrival"), next((s for n, s, _ in prefill if n == "arrival"), None))
                    if t is not None]
        spans = [x for x in trace.spans if x[0] not in ("arrival", "done")]
        req.extra_meta["kv_transfer"]["trace"] = render([x for x in prefill if x[0] != "arrival"], spans, arrivals, now)
        self.first_steps[req] = (now, min(arrivals))

    def _admit_fake(self, req) -> None:
        """SGLang's fake backend: the prompt's KV slots are allocated and left unwritten, and the
        first token is a placeholder (the last prompt token); outputs are meaningless."""
        n = len(req.origin_input_ids)
        if not self.kv.admit_external(req):
            self.ctx.requeue(req)
            return
        slots = self.kv.alloc([req], [n], [0])
        if slots is None:
            self.kv.release(req)
            self.ctx.requeue(req)
            return
        self.table.write(req.req_pool_idx, 0, slots)
        req.kv_len = n
        req.output_ids.append(req.origin_input_ids[-1])
        self.ready.append(req)
