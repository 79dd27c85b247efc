"""The prefill role's chunk streams (mixed into PrefillRole, prefill.py): an untiered pool's
chunks as stored, and the tiered "chunk" / "chunk-upgrade" streams (tiers at each chunk's end,
the prompt end at the final tiers); on CUDA each packs on the side stream after its chunk.

Invariants:
- A chunk's range is packed after that chunk's kernels (its PackStream mark) and before the
  prompt's re-tier moves its rows: `_on_final_tiers` runs ahead of the move and joins the side
  stream, so the move's kernels queue behind every pack.
- Ranges are packed in position order, so the unpacked ones are always a suffix of `pending`.
- Every place after which a request's rows may move, be freed or be reused calls `_join_packs`.
"""
from __future__ import annotations

import time

import torch

from sgl_kvxfer.disagg.pack_stream import RowSnapshot
from sgl_kvxfer.disagg.prefill_room import CHUNK_STREAMS, PrefillRoom, _Range


class PrefillChunkStream:
    """PrefillRole's chunk-stream hooks; reads the role's rooms, tiering, pool and side stream."""

    def after_launch(self, batch) -> None:
        """On a GPU, an event right behind the chunk's kernels marks its end (with overlapped
        chunks the next chunk is in the stream before this one's results are applied): a traced
        room's chunk span waits for it, and the chunk packs on the side stream after it
        (pack_stream.py): every chunk of an untiered pool, with its row's slot ids snapshotted
        behind it; every chunk but the last of a tiered chunk stream (the last is packed at the
        final tiers)."""
        if not str(self.device).startswith("cuda"):
            return
        traced, marked, rows = [], [], []
        for s in batch.slices:
            room, end = self._room_of(s.req), s.start + s.length
            if room is None:
                continue
            if self.settings.trace and getattr(room, "trace", None) is not None:
                traced.append((room, end))
            if self.packs is None or getattr(room, "chunk_rows", None) is None:
                continue  # (an SCD producer's room streams codes, not KV ranges)
            if not self.tiered:  # every chunk, the last too: each leaves as the pool stores it
                marked.append((room, end))
                rows.append((room, s.req, end))
            elif room.stream in CHUNK_STREAMS and end < s.req.seq_len:
                marked.append((room, end))
        if not (traced or marked):
            return
        if self.packs is not None:
            done = self.packs.mark()
        else:
            done = torch.cuda.Event()
            done.record()
        for room, end in traced:
            room.chunk_done[end] = done
        for room, end in marked:
            room.chunk_marks[end] = done
        for room, req, end in rows:  # queued behind this chunk's kernels, ahead of any later launch
            room.chunk_rows[end] = RowSnapshot(self.table.read(req.req_pool_idx, end))

    def on_chunk(self, req, start: int, end: int) -> None:
        room = self._room_of(req)
        if room is None or room.error:
            return
        if self.tiered and room.stream == "end":  # nothing leaves before the final tiers exist
            room.chunk_ends.append(end)
            return
        # from `streamed`, not `start`: a prompt whose head came from the prefix cache has its
        # first chunk start past 0, and the decode needs those cached positions too
        start = room.streamed
        if not self.tiered:
            room.pending.append(self._stored_range(room, start, end))
        elif room.stream == "int8":
            room.pending.append(_Range(start, end, "int8"))
        else:  # chunk streams: tiers at budget b for this chunk, from what is known now
            t0 = time.time()
            tiers, slots = self.tiering.chunk_tiers(req, start, end, with_slots=True)
            after = room.chunk_marks.pop(end, None)
            for stale in [e for e in room.chunk_marks if e < end]:  # (none in order; a retry's)
                del room.chunk_marks[stale]
            room.pending.append(_Range(start, end, "chunk", tiers, slots, after))
            if room.trace is not None:
                room.trace.add(f"chunk_tier[{start}:{end}]", t0)
        room.streamed = end
        if not self.tiered or room.stream in CHUNK_STREAMS:
            # pack now, while the next chunk (launched before this one's results were applied,
            # when chunks overlap) computes: a range still pending when the prompt ends would
            # go at the final tiers after the re-tier instead
            self._pump(room)

    def _stored_range(self, room: PrefillRoom, start: int, end: int) -> _Range:
        """Positions [start, end) as the pool stores them (an untiered pool). On CUDA, with the
        row snapshot of the chunk that ends at `end`, the range carries its host slot ids and
        packs on the side stream after that chunk's kernels: the scheduler thread never waits
        for a chunk launched after it (reading the row here would wait for the whole stream)."""
        snap = room.chunk_rows.pop(end, None)
        after = room.chunk_marks.pop(end, None)
        for stale in [e for e in room.chunk_rows if e < end]:  # (none in order; a retry's)
            room.chunk_rows.pop(stale)
            room.chunk_marks.pop(stale, None)
        if snap is None or after is None:
            return _Range(start, end, "stored")
        return _Range(start, end, "stored", None, snap.host()[start:end], after)

    def last_chunk_tokens(self, req) -> int:
        """--kv-transfer-last-chunk for a tiered chunk stream's request: its last chunk is short,
        so the segment that can only leave once the prompt is done (at the final tiers) is short
        too, and the rest streamed under the compute (0: chunks as the chunk size cuts them; the
        scheduler cuts only a rest of one chunk and at least twice this, Scheduler._chunk_limit)."""
        room = self._room_of(req)
        if room is None or not self.tiered or getattr(room, "stream", None) not in CHUNK_STREAMS:
            return 0  # (an SCD room streams codes, not chunk tiers)
        return room.last_chunk

    def stream_chunk_tokens(self, req) -> int:
        """--kv-transfer-stream-chunk for a request whose chunks leave as they are computed (an
        untiered pool, or a tiered one streaming int8 or chunk tiers) while the link is slower
        than NVLink: paced, or Mooncake over RDMA or TCP. Over unpaced NVLink a whole prompt's
        KV crosses in milliseconds (1 GiB in about 3 ms between two H200s), so chunks keep the
        chunk size and the write does not share GPU 0 with the next chunk's forward (0 here)."""
        cap = self.settings.stream_chunk
        if not cap or self.fake:
            return 0
        room = self._room_of(req)
        if not isinstance(room, PrefillRoom) or (self.tiered and room.stream == "end"):
            return 0  # (an SCD room streams codes; a tiered "end" room sends nothing before the end)
        engine = self.engine
        transport = getattr(getattr(engine, "inner", engine), "transport", None)
        return 0 if transport == "nvlink_intra" and not getattr(engine, "paced", False) else cap

    def _on_final_tiers(self, req, start: int, slots: torch.Tensor, tiers: torch.Tensor) -> None:
        try:
            self._pack_final(req, start, slots, tiers)
        finally:
            # NOTE: the re-tier moves the prompt's rows and frees its fp16 ones right after this
            # hook: its kernels (and any later reuse of those rows) queue behind every side pack
            self._join_packs()

    def _pack_final(self, req, start: int, slots: torch.Tensor, tiers: torch.Tensor) -> None:
        """A chunk stream's prompt end, after its final tiers are assigned and before the re-tier
        moves its KV (EngineTiering.final_tiers_hook): what has not left yet (the last chunk,
        and chunks the link has not taken) is packed now at the final tiers asked for, quantized
        from the model-dtype rows on the way, so its write does not wait for the move. The
        pack's kernels are enqueued ahead of the move's, which is what keeps the rows it reads
        intact. A range the ring or the send buffer cannot take yet stays pending and is dropped
        at on_prompt_done (_finalize_chunks): it then goes as the pool's stored codes. Where the
        re-tier gets a more precise tier than asked (a short store), `chunk-upgrade` resends it."""
        room = self._room_of(req)
        if room is None or room.error or getattr(room, "stream", None) not in CHUNK_STREAMS:
            return
        n = len(req.origin_input_ids)
        first = room.pending[0].start if room.pending else room.streamed  # packed in order: a suffix
        if start + slots.numel() != n or not start <= first < n:
            return  # positions before `start` are the cache's, at their cached tiers: stored codes
        room.pending.clear()
        room.pending.append(_Range(first, n, "chunk", tiers[first - start:], slots[first - start:]))
        room.streamed = n
        self._pump(room)  # (on the current stream: these ranges carry no chunk event)

    def _finalize_chunks(self, room: PrefillRoom, n: int) -> None:
        """Prompt end of a chunk stream: chunk ranges not packed yet go at the final tiers
        instead (none of their bytes left), and the upgrade pass covers what did leave."""
        if room.pending:  # NOTE: packed in order, so the unpacked chunks are a suffix
            room.streamed = room.pending[0].start
            room.pending.clear()
        if room.stream == "chunk-upgrade" and room.streamed:
            room.pending.append(_Range(0, room.streamed, "upgrade"))

    def _join_packs(self) -> None:
        """NOTE: side-stream packs read pool rows that only compute-stream kernels change. Every
        place after which the request's rows may move, be freed or be reused (the final re-tier,
        a failed or finished room, the end of each poll: before the step's forward, after an
        abort's or a failed batch's frees) joins first, so those kernels queue behind the packs.
        No host wait."""
        if self.packs is not None:
            self.packs.join()
