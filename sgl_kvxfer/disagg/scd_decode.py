"""The SCD consumer: a decode role that rebuilds its own KV from a producer's codes
(docs/pd_disaggregation.md, "SCD over PD").

The room's steps are DecodeRole's (decode.py); what differs:

    bootstrap   the prefill's /route must carry `scd` with this server's manifest id and name
                this consumer; anything else fails the request with 400 and the reason (a
                misconfigured pair is not a transfer fault: no local prefill hides it)
    claim       names the artifacts (ScdClaimInfo); the staging region is sized for codes
    segment     verified as usual, then rebuilt into freshly allocated slots: Reuse layers by
                low-rank decode + RoPE, Patch layers by aligner and this model's own W_k / W_v +
                RoPE, each kind for all its layers at once (scd/rebuild.py: a fixed few dozen
                launches per segment); `KVPool.write_layers` stores each kind in one write
    done        codes cover positions [0, n - 1): the request joins the running batch with
                kv_len = n - 1 and no token, and its first decode step computes the last prompt
                position with this model and samples the first token

Rebuilt KV is an approximation: it never enters the prefix cache (Req.share_prefix). A
transfer fault (checksum, timeout, KVFailed) ends in a local prefill, as for KV.

--enable-pd-trace (disagg/trace.py): a traced room's spans are DecodeRole's (bootstrap,
unpack[s]: the segment's checksum and its rebuild launched, unpack_wait, admit) with the
producer's (scd_prefill.py: code[s], pack[s], wire[s], ...). The first token here comes from the
first decode step, so the rendered trace adds `ttft_ms` (arrival -> that step's end) beside
`critical_ms` (arrival -> admission), and `rebuild_gpu_ms`: the rebuild's device time summed
over segments, by part (unpack_codes, reuse: codes -> K/V of the Reuse layers, patch: aligned
hidden states -> this model's K/V of the Patch layers, kv_write: into the pool), from CUDA
timing events that nothing waits on (on a CPU, host time: the work is synchronous there);
`rebuild_host_ms`: the same parts' host time (launches, and any wait inside them; a segment's
unpack[s] span less these is its checksum and slot allocation), and on CUDA
`rebuild_cuda_alloc`: the caching allocator's retries and device mallocs over the room's rebuilds.
"""
from __future__ import annotations

import contextlib

import dataclasses
import logging
import time

import torch

from sgl_kvxfer.disagg.decode import DecodeRole, DecodeRoom
from sgl_kvxfer.disagg.scd_common import load_consumer
from sgl_kvxfer.mem_cache.scd_payload import CodeLayout, unpack_codes
from sgl_kvxfer.message.disagg import KVSegment, ScdClaimInfo

logger = logging.getLogger(__name__)

# tokens per rebuild chunk: at the Llama-3-8B shape (26 Reuse layers of 8 x 128) a chunk's float32
# K or V over all Reuse layers is 218 MB; a chunk costs a fixed few dozen launches
REBUILD_CHUNK_TOKENS = 2048


class _Marks:
    """Part boundaries of a traced room's rebuilds: (name, CUDA timing event or None, host time).
    A part's time runs from the mark before it; a "start" mark opens a segment. Beside the device
    time, the host time of each part (the launches and any wait inside them) and, on CUDA, the
    caching allocator's retries (a retry frees cached blocks: a device sync) and device mallocs
    over the room's rebuilds."""

    def __init__(self, cuda: bool):
        self.cuda, self.points = cuda, []
        self.alloc0 = _alloc_counts() if cuda else None

    def mark(self, name: str) -> None:
        e = None
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
        self.points.append((name, e, time.perf_counter()))

    def durations_ms(self) -> dict:
        if self.cuda and self.points:
            self.points[-1][1].synchronize()  # done already: the room's last unpack was waited for
        out = {}
        for (_, a, ha), (name, b, hb) in zip(self.points, self.points[1:]):
            if name != "start":
                out[name] = out.get(name, 0.0) + (a.elapsed_time(b) if self.cuda else 1e3 * (hb - ha))
        return {k: round(v, 3) for k, v in out.items()}

    def host_ms(self) -> dict:
        out = {}
        for (_, _, ha), (name, _, hb) in zip(self.points, self.points[1:]):
            if name != "start":
                out[name] = out.get(name, 0.0) + 1e3 * (hb - ha)
        return {k: round(v, 3) for k, v in out.items()}

    def alloc_delta(self) -> dict | None:
        if self.alloc0 is None:
            return None
        now = _alloc_counts()
        return {k: now[k] - self.alloc0[k] for k in now}


def _alloc_counts() -> dict:
    stats = torch.cuda.memory_stats()
    return {"retries": int(stats.get("num_alloc_retries", 0)), "device_mallocs": int(stats.get("num_device_alloc", 0))}


@contextlib.contextmanager
def tf32_matmuls(on: bool):
    """float32 matmuls on TF32 tensor cores while `on` (the rebuild's GEMMs on a GPU). The
    rebuilt K/V are rounded to the pool's bf16 / fp16, whose 7 / 10 mantissa bits are no finer
    than TF32's 10-bit inputs, so the pool holds what full float32 would give to within its own
    rounding. HAZARD: the flag is process-wide; the rebuild runs on the scheduler thread, and no
    other thread of a decode server runs float32 matmuls meanwhile."""
    if not on:
        yield
        return
    matmul = torch.backends.cuda.matmul
    old = matmul.allow_tf32
    matmul.allow_tf32 = True
    try:
        yield
    finally:
        matmul.allow_tf32 = old


class ScdDecodeRole(DecodeRole):
    def __init__(self, settings, host: str):
        super().__init__(settings, host)
        self.marks: dict[int, _Marks] = {}  # --enable-pd-trace: room -> its rebuilds' part boundaries

    def start(self, ctx) -> None:
        runner, settings = ctx.runner, self.settings
        self.artifacts, self.consumer, self.manifest_id = load_consumer(settings.scd_artifacts, runner,
                                                                        settings.scd_consumer)
        self.manifest = self.artifacts.manifest
        from sgl_kvxfer.scd.codec import ScdDecoder, kv_projections
        from sgl_kvxfer.scd.rebuild import StackedRebuild

        self.decoder = ScdDecoder(self.artifacts, self.consumer, runner.device)
        self.projections = kv_projections(runner.model)
        # stacked decoders, aligners and float32 W_k / W_v on the device once, not per segment
        self.stacked = StackedRebuild(self.decoder, self.projections, runner.device)
        self.code_layout = CodeLayout.from_manifest(self.manifest)  # the top level: the largest
        # a segment's level is read from its bytes per token (distinct per level; scd_prefill.py)
        self.layout_by_bpt = {lay.bytes_per_token: lay for lay in
                              (CodeLayout.from_manifest(self.manifest, lv) for lv in self.manifest.levels)}
        self.patch_layers = frozenset(self.manifest.patch_layers)
        self.claim_info = ScdClaimInfo(self.manifest_id, self.consumer)
        super().start(ctx)
        logger.info("SCD consumer %r of artifacts %s (id %s): %d B/token of codes", self.consumer,
                    settings.scd_artifacts, self.manifest_id[:12], self.code_layout.bytes_per_token)

    def on_new_request(self, req) -> bool:
        if self.takes(req):
            req.share_prefix = False  # rebuilt KV is approximate: never shared
        return super().on_new_request(req)

    def server_info(self) -> dict:
        return {**super().server_info(), "scd": {"manifest_id": self.manifest_id, "consumer": self.consumer,
                                                 "bytes_per_token": self.code_layout.bytes_per_token}}

    # ------------------------------------------------------------------ DecodeRole's steps
    def _check_route(self, room: DecodeRoom, info: dict) -> bool:
        b = room.req.bootstrap
        where = f"{b.host}:{b.port if b.port is not None else self.settings.bootstrap_port}"
        scd = info.get("scd")
        if not scd:
            self._reject(room, f"the prefill at {where} ships KV, not SCD codes (it runs without --scd-artifacts); "
                               f"this decode server rebuilds KV from codes of artifacts {self.manifest_id[:12]}")
            return False
        if scd.get("manifest_id") != self.manifest_id:
            self._reject(room, f"SCD artifacts differ: the prefill at {where} encodes with "
                               f"{str(scd.get('manifest_id'))[:12]}, this decode server ({self.consumer}) decodes "
                               f"with {self.manifest_id[:12]}; both need the same calibration output")
            return False
        if self.consumer not in scd.get("consumers", ()):
            self._reject(room, f"the prefill at {where} encodes for consumers {scd.get('consumers')}, "
                               f"not {self.consumer!r}")
            return False
        return True

    def _region_bytes(self, prompt_len: int) -> int:
        return self.code_layout.nbytes(max(prompt_len - 1, 0)) + (1 << 16)

    def _scd_claim(self):
        return self.claim_info

    def _write_segment(self, req, seg: KVSegment, payload: torch.Tensor) -> bool:
        """Allocate slots for the segment's positions and store the KV rebuilt from its codes."""
        room = self.rooms[req.bootstrap.room]
        if not seg.codes:
            self._end(room, "the prefill sent KV segments to an SCD consumer")
            return False
        if seg.start != req.kv_len or seg.end > len(req.origin_input_ids) - 1:
            self._end(room, f"codes for positions [{seg.start}, {seg.end}) do not continue [0, {req.kv_len})")
            return False
        n = seg.end - seg.start
        n_bytes, rem = divmod(seg.nbytes, max(1, n))
        layout = self.layout_by_bpt.get(n_bytes) if not rem else None
        if layout is None:
            self._end(room, f"a code segment of {seg.nbytes} B for {n} positions matches no rank level of the "
                            f"artifacts ({sorted(self.layout_by_bpt)} B per token)")
            return False
        slots = self.kv.alloc([req], [n], [seg.start])
        if slots is None:
            return False  # no KV room yet: retried next poll (the prefill waits for the ack)
        # the row owns the slots from here: a failure below frees them with the request's KV
        self.table.write(req.req_pool_idx, seg.start, slots)
        req.kv_len = seg.end
        marks = None
        if room.trace is not None:
            marks = self.marks.setdefault(room.room, _Marks(str(self.pool.device).startswith("cuda")))
            marks.mark("start")
        try:
            for a, b, groups in self._rebuild(payload, seg.start, seg.end, layout, marks):
                for layer_ids, k, v in groups:
                    self.pool.write_layers(slots[a:b], layer_ids, k, v)
                if marks is not None:
                    marks.mark("kv_write")
        except Exception as e:  # noqa: BLE001 (kv_len has moved on: any failure ends the room here, never a retry)
            self._end(room, f"rebuilding KV from codes failed: {type(e).__name__}: {e}")
            return False
        return True

    def _rebuild(self, payload: torch.Tensor, start: int, end: int, layout: CodeLayout | None = None,
                 marks: _Marks | None = None, max_tokens: int = REBUILD_CHUNK_TOKENS):
        """Yields (a, b, layer groups) per chunk of at most `max_tokens` of the segment's tokens:
        the K/V of its tokens [a, b) (segment-relative) as (layer ids, k post-RoPE, v
        [L', b - a, Hkv, D]) in the pool's dtype (scd/rebuild.py), from codes at `layout`'s level
        (default the top). The caller stores a chunk before asking for the next: a chunk's
        float32 intermediates over all Reuse layers at once are what bounds the rebuild's memory.
        `marks`: the trace's part boundaries."""
        dev, dtype = self.pool.device, self.pool.dtype
        layout = layout or self.code_layout
        mark = marks.mark if marks is not None else (lambda name: None)
        n = end - start
        # one copy to the device (the staging bytes are free to reuse once it returns: acked next)
        raw = payload[:layout.nbytes(n)].to(dev)
        if not layout.bits and layout.dtype != torch.float32:
            # every field widened to float32 in one exact cast, not one cast per field (the
            # decoder computes in float32: each layer's .float() is then a no-op); the fields
            # keep their order, so the float32 layout's offsets address the widened bytes
            raw = raw.view(layout.dtype).float().view(torch.uint8)
            layout = dataclasses.replace(layout, dtype=torch.float32)
        codes = unpack_codes(layout, raw, n)
        positions = torch.arange(start, end, device=dev)
        mark("unpack_codes")
        # every Reuse layer in one batched GEMM per K / V, every Patch layer likewise (scd/rebuild.py):
        # a chunk costs the same few dozen launches at 63 tokens as at 2048 (the pool keeps the
        # device it was given: a torch.device or a string such as "cuda:0")
        with tf32_matmuls(torch.device(dev).type == "cuda" and dtype in (torch.bfloat16, torch.float16)):
            for a in range(0, n, max_tokens):
                b = min(n, a + max_tokens)
                pos = positions[a:b]
                self.decoder.rotary.prime(pos, num_positions=start + b)  # the chunk's RoPE: one lookup, no sync
                yield a, b, self.stacked.rebuild({key: c[a:b] for key, c in codes.items()}, pos, dtype, mark)

    def _succeed(self, room: DecodeRoom) -> None:
        req, done = room.req, room.done
        n = len(req.origin_input_ids)
        if req.kv_len != n - 1:
            self._end(room, f"the codes covered {req.kv_len} of the prompt's first {n - 1} positions")
            return
        b = req.bootstrap
        req.cached_tokens = 0
        req.extra_meta = {"kv_transfer": {
            "status": "ok", "scd": {"manifest": self.manifest_id[:12], "consumer": self.consumer},
            "bytes": room.wire_bytes, "bytes_per_token": room.wire_bytes / n, "segments": room.unpacked,
            "transfer_ms": 1e3 * (time.monotonic() - room.claimed_at),  # claim -> every segment rebuilt
            "wire_ms": 1e3 * done.wire_seconds, "tail_ms": 1e3 * done.tail_seconds,
            "link_gbps": room.wire_bytes * 8 / done.wire_seconds / 1e9 if done.wire_seconds else 0.0,
            # where the codes are: other consumers of a fan-out claim the same room (scd_fanout.py)
            "bootstrap_host": b.host, "bootstrap_port": b.port, "bootstrap_room": b.room}}
        marks = self.marks.pop(room.room, None)
        if marks is not None:
            req.extra_meta["kv_transfer"]["rebuild_gpu_ms"] = marks.durations_ms()
            req.extra_meta["kv_transfer"]["rebuild_host_ms"] = marks.host_ms()
            alloc = marks.alloc_delta()
            if alloc is not None:
                req.extra_meta["kv_transfer"]["rebuild_cuda_alloc"] = alloc
        self.stats.outcome("ok")
        self.stats.tokens += n
        self._release_room(room)
        if room.trace is not None:  # rendered at admission (DecodeRole.poll)
            room.trace.add("done", time.time(), time.time())
            self.traces[req] = (done.trace or [], room.trace)
        self.ready.append(req)

    def after_forward(self, batch) -> None:
        """--enable-pd-trace: the first token comes from this first decode step: `ttft_ms`."""
        firsts = [s.req for s in batch.slices if s.req in self.first_steps] if self.first_steps else []
        super().after_forward(batch)
        for req in firsts:
            trace = req.extra_meta.get("kv_transfer", {}).get("trace")
            step = next((p for p in reversed(trace["phases"]) if p[0] == "d.first_step"), None) if trace else None
            if step is not None:
                trace["ttft_ms"] = round(step[1] + step[2], 3)
                trace["by_phase_ms"]["d.first_step"] = step[2]

    def _end(self, room: DecodeRoom, reason: str, fallback: bool = True, notify: bool = True) -> None:
        self.marks.pop(room.room, None)
        if fallback:
            room.req.share_prefix = True  # the local prefill computes exact KV
        super()._end(room, reason, fallback, notify)
