"""The decode role's deferred checksums (disagg/decode_receive.py): a segment's sums are launched with its
unpack and compared when their event is done; a segment is acked, and a room admitted, only once
its sums match; a mismatch fails the room as before (KVCancel, slots freed, a local prefill).
CPU tests stand in for a pending CUDA event; the GPU test runs the real one."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from sgl_kvxfer.disagg import decode as decode_mod
from sgl_kvxfer.disagg import decode_receive
from sgl_kvxfer.disagg.base import KVPoll
from sgl_kvxfer.disagg.buffers import BLOCK_BYTES, PendingChecksums, TransferBuffer, block_checksums
from sgl_kvxfer.disagg.common import TransferStats
from sgl_kvxfer.disagg.decode import DecodeRole, DecodeRoom
from sgl_kvxfer.disagg.staging import StagingAllocator
from sgl_kvxfer.message.disagg import KVAck, KVCancel, KVDone, KVSegment

SEG_BYTES = 3000
PROMPT = 8  # two segments of 4 positions


class _Role(DecodeRole):
    """DecodeRole without sockets or a pool: writes and messages are recorded."""

    def __init__(self, staging: TransferBuffer):
        super().__init__(SimpleNamespace(backend="mooncake", trace=True, timeout_s=30.0, bootstrap_port=1), "h")
        self.staging, self.regions, self.quarantine, self.routes = staging, StagingAllocator(staging.numel()), [], {}
        self.monitor, self.decode_id = SimpleNamespace(is_dead=lambda peer: False), "tcp://d:3"
        self.stats, self.pushed, self.written, self.released, self.requeued = TransferStats(), [], [], [], []
        self.kv = SimpleNamespace(release=self.released.append)
        self.ctx = SimpleNamespace(requeue=self.requeued.append)

    def _push(self, endpoint, msg) -> None:
        self.pushed.append(msg)

    def _write_segment(self, req, seg, payload) -> bool:
        self.written.append((seg.seq, payload.clone()))
        req.kv_len = seg.end
        return True


class _Req(SimpleNamespace):
    """A request: the role keeps traced requests in weak-keyed maps (by identity)."""
    __slots__ = ("__weakref__",)
    __hash__ = object.__hash__


def _room(role: _Role) -> DecodeRoom:
    req = _Req(rid="r", bootstrap=SimpleNamespace(host="p", port=1, room=5), output_ids=[],
                          origin_input_ids=list(range(PROMPT)), kv_len=0, return_logprob=False, extra_meta={})
    room = role.rooms[5] = DecodeRoom(5, req, state=KVPoll.TRANSFERRING, endpoint="tcp://p:2")
    room.region, room.region_bytes, room.claimed_at = role.regions.alloc(4 * SEG_BYTES), 4 * SEG_BYTES, time.monotonic()
    room.trace = decode_mod.PhaseTrace()
    return room


def _land(role: _Role, room: DecodeRoom, seq: int, kind: str, corrupt: bool = False) -> KVSegment:
    """The prefill's write of segment `seq` into the room's region, then its KVSegment."""
    data = torch.randint(0, 256, (SEG_BYTES,), dtype=torch.uint8)
    sums = block_checksums(data, kind, BLOCK_BYTES)
    if corrupt:
        data[SEG_BYTES // 2] ^= 0x10
    offset = seq * SEG_BYTES
    role.staging[room.region + offset:room.region + offset + SEG_BYTES].copy_(data)
    seg = KVSegment(5, seq, 4 * seq, 4 * seq + 4, None, (4, 0, 0), offset, SEG_BYTES, BLOCK_BYTES, sums,
                    checksum_kind=kind)
    room.segments[seq] = seg
    return seg


class _HeldChecksums(PendingChecksums):
    """A launch whose event is still pending until the test releases it."""
    held = True

    def ready(self) -> bool:
        return not _HeldChecksums.held

    def wait(self) -> None:
        _HeldChecksums.held = False


@pytest.fixture
def held(monkeypatch):
    monkeypatch.setattr(decode_receive, "PendingChecksums", _HeldChecksums)
    _HeldChecksums.held = True
    return _HeldChecksums


def _acks(role):
    return [m.seq for m in role.pushed if isinstance(m, KVAck)]


@pytest.mark.parametrize("kind", ["xxh3", "wsum64"])
def test_good_segments_unpack_before_their_sums_and_ack_after(held, kind):
    role = _Role(TransferBuffer(1 << 16, "cpu", False))
    room = _room(role)
    _land(role, room, 0, kind)
    role._advance(room, time.monotonic())
    assert [s for s, _ in role.written] == [0] and _acks(role) == []  # unpacked, not acked: sums pending
    held.held = False
    role._advance(room, time.monotonic())
    assert _acks(role) == [0] and not room.unverified
    _land(role, room, 1, kind)
    room.done = KVDone(5, 2, 42, 0, 2 * SEG_BYTES)
    held.held = True  # the last segment's sums pending: the room waits for them, then succeeds
    role._advance(room, time.monotonic())
    assert _acks(role) == [0, 1] and 5 not in role.rooms and role.ready == [room.req]
    assert room.req.output_ids == [42] and "checksum_wait" in [n for n, *_ in room.trace.spans]


@pytest.mark.parametrize("kind", ["xxh3", "wsum64"])
def test_a_corrupt_segment_fails_the_room_once_its_sums_are_read(held, kind):
    role = _Role(TransferBuffer(1 << 16, "cpu", False))
    room = _room(role)
    _land(role, room, 0, kind)
    _land(role, room, 1, kind, corrupt=True)
    role._advance(room, time.monotonic())
    assert [s for s, _ in role.written] == [0, 1] and 5 in role.rooms and _acks(role) == []
    held.held = False
    role._advance(room, time.monotonic())
    assert 5 not in role.rooms and role.ready == [] and role.requeued == [room.req]
    assert role.released == [room.req]  # every slot the room's segments landed in
    assert 1 not in _acks(role)  # the corrupt segment is never acked
    cancel = [m for m in role.pushed if isinstance(m, KVCancel)]
    assert len(cancel) == 1 and cancel[0].reason.startswith("checksum mismatch in segment 1 block 0")
    assert room.req.extra_meta["kv_transfer"]["status"].startswith("fallback: checksum mismatch")


def test_a_corrupt_last_segment_never_admits_the_request():
    """Host payloads (no event): the sums are read in the same poll; KVDone is in already."""
    role = _Role(TransferBuffer(1 << 16, "cpu", False))
    room = _room(role)
    _land(role, room, 0, "xxh3")
    _land(role, room, 1, "xxh3", corrupt=True)
    room.done = KVDone(5, 2, 42, 0, 2 * SEG_BYTES)
    role._advance(room, time.monotonic())
    assert 5 not in role.rooms and role.ready == [] and role.requeued == [room.req] and 1 not in _acks(role)


def test_pending_checksums_on_the_host_are_immediate():
    data = torch.randint(0, 256, (BLOCK_BYTES + 77,), dtype=torch.uint8)
    for kind in ("xxh3", "wsum64"):
        pending = PendingChecksums(data, kind, BLOCK_BYTES)
        assert pending.event is None and pending.ready()
        assert pending.first_bad(block_checksums(data, kind, BLOCK_BYTES)) is None
        assert pending.first_bad(block_checksums(data[:BLOCK_BYTES], kind, BLOCK_BYTES)) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["xxh3", "wsum64"])
def test_gpu_staging_launches_sums_without_a_host_wait(monkeypatch, kind):
    """Sums launched behind queued GPU work are not ready at once (the scheduler thread goes
    on); once done they name the corrupt block, and the room fails without an ack for it."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    monkeypatch.setenv("SGL_KVXFER_KV_BUFFER", "device")
    data = torch.randint(0, 256, (2 * BLOCK_BYTES + 333,), dtype=torch.uint8)
    want = block_checksums(data, kind, BLOCK_BYTES)
    dev = data.cuda()
    dev[BLOCK_BYTES + 5] ^= 0x01
    for size in (dev.numel(), SEG_BYTES):  # first-use costs (multipliers, pinned blocks) are not the point
        PendingChecksums(dev[:size], kind, BLOCK_BYTES).wait()
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)
    t0 = time.time()
    pending = PendingChecksums(dev, kind, BLOCK_BYTES)
    assert time.time() - t0 < 0.05 and not pending.ready()
    pending.wait()
    assert pending.ready() and pending.first_bad(want) == 1

    role = _Role(TransferBuffer(1 << 16, "cuda", True))
    assert role.staging.on_device
    room = _room(role)
    _land(role, room, 0, kind)
    _land(role, room, 1, kind, corrupt=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # the segments' sums queue behind this
    role._advance(room, time.monotonic())
    assert [s for s, _ in role.written] == [0, 1] and 5 in role.rooms and _acks(role) == []
    torch.cuda.synchronize()
    role._advance(room, time.monotonic())
    assert 5 not in role.rooms and role.requeued == [room.req] and 1 not in _acks(role)
