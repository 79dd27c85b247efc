"""The sender thread's coalescing (disagg/sender.py): WriteJobs queued behind a write in flight,
of one room and decode and contiguous on both sides, go out as one engine write; each still
reports its own result and KVSegment. A paced link, a fault or a gap keeps them apart."""
from __future__ import annotations

import threading

import torch

from sgl_kvxfer.disagg.base import TransferEngine
from sgl_kvxfer.disagg.common import Fault
from sgl_kvxfer.disagg.sender import SenderThread, WriteJob
from sgl_kvxfer.message.disagg import KVSegment

SEG = 8192


class _HeldEngine(TransferEngine):
    """Records writes; the first one waits until the test lets it go (jobs queue behind it)."""
    name = "held"
    gpu_memory = False

    def __init__(self, paced: bool = False):
        self.writes, self.release, self.paced = [], threading.Event(), paced

    def session_id(self) -> str:
        return "held"

    def register(self, addr: int, nbytes: int) -> None:
        pass

    def write(self, peer: str, src_addr: int, dst_addr: int, nbytes: int) -> None:
        if not self.writes:
            self.writes.append((src_addr, dst_addr, nbytes))
            self.release.wait(10)
        else:
            self.writes.append((src_addr, dst_addr, nbytes))

    def describe(self) -> dict:
        return {}

    def close(self) -> None:
        pass


def _send(engine, dst_offsets, faults=None, rooms=None):
    """Submit one job per dst offset (consecutive SEG-byte payloads of one buffer) while the
    first write is held; the results and pushed segments once all are done."""
    buf = torch.randint(0, 256, (SEG * len(dst_offsets),), dtype=torch.uint8)
    sender = SenderThread(engine, faults, coalesce=True)
    pushed = []
    sender._push = lambda endpoint, msg: pushed.append(msg)
    rooms = rooms or [1] * len(dst_offsets)
    deadline = threading.Event()
    for seq, (dst, room) in enumerate(zip(dst_offsets, rooms)):
        seg = KVSegment(room, seq, seq, seq + 1, None, (1, 0, 0), dst, SEG, 0, [])
        sender.submit(WriteJob(room, seq, buf[seq * SEG:(seq + 1) * SEG], "peer", 1_000_000 + dst, "tcp://d:1", seg))
        while seq == 0 and not engine.writes and not deadline.wait(0.005):
            pass  # the first write is in flight: the rest queue behind it
    engine.release.set()
    results = []
    for _ in range(200):
        results += sender.drain()
        if len(results) == len(dst_offsets):
            break
        deadline.wait(0.02)
    sender.close()
    base = buf.data_ptr()
    return [(s - base, d - 1_000_000, n) for s, d, n in engine.writes], results, pushed


def test_contiguous_jobs_queued_behind_a_write_go_as_one():
    writes, results, pushed = _send(_HeldEngine(), [0, SEG, 2 * SEG, 5 * SEG])
    # job 3's bytes follow job 2's in the send buffer but not in the ring: a write of its own
    assert writes == [(0, 0, SEG), (SEG, SEG, 2 * SEG), (3 * SEG, 5 * SEG, SEG)]
    assert [r.seq for r in results] == [0, 1, 2, 3] and all(r.error is None for r in results)
    assert [r.nbytes for r in results] == [SEG] * 4
    assert [m.seq for m in pushed] == [0, 1, 2, 3] and all(len(m.checksums) == 1 for m in pushed)


def test_a_paced_link_a_faulty_room_or_another_room_writes_each_job_alone():
    for engine, faults, rooms in ((_HeldEngine(paced=True), None, None),
                                  (_HeldEngine(), Fault.parse("delay:0@1"), None),
                                  (_HeldEngine(), None, [1, 1, 2])):
        writes, results, _ = _send(engine, [0, SEG, 2 * SEG], faults, rooms)
        assert len(writes) == 3 and all(r.error is None for r in results)
