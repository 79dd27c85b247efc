"""PD plumbing without a model: transfer-buffer bookkeeping, control messages, the router's
bootstrap fields, block checksums, fault specs, the paced link and the bootstrap server's API
(sglang-compat section 4.4)."""
import threading
import time

import pytest
import requests
import torch

from sgl_kvxfer.disagg.base import TransferEngine
from sgl_kvxfer.disagg.buffers import block_checksums, first_bad_block
from sgl_kvxfer.disagg.common import Fault
from sgl_kvxfer.disagg.shaped import ShapedTransferEngine
from sgl_kvxfer.disagg.staging import ALIGN, RingWriter, StagingAllocator
from sgl_kvxfer.message import decode, encode
from sgl_kvxfer.message.disagg import KVAck, KVCancel, KVClaim, KVDone, KVFailed, KVLayoutInfo, KVRegister, KVSegment
from sgl_kvxfer.tokenizer.generate_input import RequestError, parse_bootstrap, parse_generate_request


def test_staging_allocator_reuses_and_merges_regions():
    a = StagingAllocator(10 * ALIGN)
    x, y, z = a.alloc(ALIGN), a.alloc(3 * ALIGN - 5), a.alloc(ALIGN)
    assert (x, y, z) == (0, ALIGN, 4 * ALIGN) and a.used_bytes() == 5 * ALIGN
    assert a.alloc(6 * ALIGN) is None  # 5 left
    a.free(y)
    a.free(x)
    assert a.alloc(4 * ALIGN) == 0  # x and y merged back into one run
    with pytest.raises(KeyError):
        a.free(y)  # a double free is a bug


def test_ring_blocks_until_acked_and_wraps():
    ring = RingWriter(8 * ALIGN)
    assert ring.place(0, 3 * ALIGN) == 0 and ring.place(1, 3 * ALIGN) == 3 * ALIGN
    assert ring.place(2, 3 * ALIGN) is None  # would overlap seg 0 after wrapping
    ring.ack(0)
    assert ring.place(2, 3 * ALIGN) == 0  # wrapped into the acked bytes
    assert not ring.fits_ever(9 * ALIGN)
    with pytest.raises(ValueError):
        ring.place(3, 9 * ALIGN)


def test_control_messages_round_trip_by_destination():
    layout = KVLayoutInfo("float16", 30, 3, 64, 32)
    to_prefill = [KVRegister(7, "tcp://d:1"), KVClaim(7, "tcp://d:1", "tcp://d:1", "d:2", 1 << 40, 4096, 100, layout), KVAck(7, "tcp://d:1", 3),
                  KVCancel(7, "tcp://d:1", "aborted")]
    to_decode = [KVSegment(7, 0, 0, 64, bytes([0, 1, 2]), (1, 1, 1), 0, 123, 4 << 20, [1, 2], replaces=True),
                 KVDone(7, 1, 42, 16, 123, [-0.5, 42], None, None), KVFailed(7, "no decode claimed the room")]
    for msgs, dest in ((to_prefill, "kv_prefill"), (to_decode, "kv_decode")):
        for msg in msgs:
            assert decode(encode(msg), dest) == msg


def test_router_bootstrap_fields_scalar_room_expands_per_item():
    boot = parse_bootstrap({"bootstrap_host": "10.0.0.5", "bootstrap_port": None, "bootstrap_room": 100}, 3)
    assert [(b.host, b.port, b.room) for b in boot] == [("10.0.0.5", None, 100 + i) for i in range(3)]
    boot = parse_bootstrap({"bootstrap_host": ["a", "b"], "bootstrap_port": [1, 2], "bootstrap_room": [5, 9]}, 2)
    assert [(b.host, b.port, b.room) for b in boot] == [("a", 1, 5), ("b", 2, 9)]
    assert parse_bootstrap({}, 2) == [None, None]
    with pytest.raises(RequestError):
        parse_bootstrap({"bootstrap_room": [1, 2, 3]}, 2)
    req = parse_generate_request({"text": ["x", "y"], "bootstrap_host": "h", "bootstrap_room": 7,
                                  "sampling_params": {"n": 2}})
    assert [i.bootstrap.room for i in req.items] == [7, 8, 9, 10]


@pytest.mark.parametrize("kind", ["xxh3", "wsum64"])
def test_block_checksums_find_corrupt_and_short_payloads(kind):
    block = 4 << 20
    data = torch.randint(0, 256, (2 * block + 1000,), dtype=torch.uint8)
    sums = block_checksums(data, kind, block)
    assert len(sums) == 3 and first_bad_block(data, sums, kind, block) is None
    for pos in (0, block + 8, 2 * block + 999):  # a flipped byte in each block, the last one short
        bad = data.clone()
        bad[pos] ^= 1
        assert first_bad_block(bad, sums, kind, block) == pos // block
    assert first_bad_block(data[:block + 100], sums, kind, block) is not None  # truncated
    swapped = data.clone()  # two 8-byte words exchanged
    swapped[8:16], swapped[64:72] = data[64:72].clone(), data[8:16].clone()
    assert (data[8:16] != data[64:72]).any() and first_bad_block(swapped, sums, kind, block) == 0


def test_wsum64_is_the_documented_sum():
    """wsum64 = sum_i w_i * m_i mod 2^64 per block, computed here with Python integers."""
    from sgl_kvxfer.disagg.buffers import BLOCK_BYTES, wsum64

    data = torch.randint(0, 256, (4099,), dtype=torch.uint8)
    raw = data.numpy().tobytes() + bytes(5)  # the short last word, zero-padded
    want = 0
    for i in range(len(raw) // 8):
        m = (i * 0x9E3779B97F4A7C15) % 2**64 | 1
        want = (want + int.from_bytes(raw[8 * i:8 * i + 8], "little") * m) % 2**64
    assert wsum64(data, BLOCK_BYTES) == [want]


def test_wsum64_async_off_cuda_is_wsum64():
    from sgl_kvxfer.disagg.buffers import wsum64, wsum64_async, wsum64_values

    data = torch.randint(0, 256, (3 * (4 << 20) + 13,), dtype=torch.uint8)
    sums, done = wsum64_async(data)
    assert done is None and wsum64_values(sums) == wsum64(data)
    assert wsum64_values(wsum64_async(data[:0])[0]) == []


def test_fault_specs_target_rooms():
    faults = Fault.parse("corrupt@7, delay:2.5@9, truncate")
    assert Fault.for_room(faults, 7).kind == "corrupt"
    assert Fault.for_room(faults, 9) == Fault("delay", 2.5, 9)
    assert Fault.for_room(faults, 1).kind == "truncate"
    assert Fault.for_room(Fault.parse(""), 1).kind == ""
    with pytest.raises(ValueError):
        Fault.parse("explode@1")


class _Recorder(TransferEngine):
    name = "recorder"

    def __init__(self):
        self.writes = []

    def session_id(self):
        return "local:0"

    def register(self, addr, nbytes):
        pass

    def write(self, peer, src_addr, dst_addr, nbytes):
        self.writes.append(nbytes)


def test_shaped_link_holds_writes_to_its_rate():
    inner = _Recorder()
    link = ShapedTransferEngine(inner, rate_gbps=0.08, latency_ms=20)  # 10 MB/s
    start = time.monotonic()
    for _ in range(3):
        link.write("p", 0, 0, 100_000)  # 10 ms each at the rate
    elapsed = time.monotonic() - start
    assert inner.writes == [100_000] * 3
    assert elapsed >= 0.03 + 0.02 - 1e-3  # three serialized writes plus the last one's latency


@pytest.fixture(scope="module")
def bootstrap_url():
    import uvicorn

    from sgl_kvxfer.disagg.bootstrap_server import create_bootstrap_app
    from servers import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_bootstrap_app(), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            if requests.get(url + "/health", timeout=1).text == "OK":
                break
        except requests.RequestException:
            time.sleep(0.05)
    yield url
    server.should_exit = True
    thread.join(timeout=5)


def test_bootstrap_server_sglang_api(bootstrap_url):
    q = "/route?prefill_dp_rank={}&prefill_cp_rank={}&target_tp_rank={}&target_pp_rank={}"
    assert requests.get(bootstrap_url + q.format(-1, -1, -1, -1)).status_code == 503  # nobody registered yet
    reg = {"attn_tp_rank": 0, "attn_dp_rank": 0, "attn_cp_rank": 0, "pp_rank": 0, "rank_ip": "10.1.1.1",
           "rank_port": 5555, "page_size": 1, "kv_cache_dtype": "auto", "transfer_session": "10.1.1.1:1234",
           "kv_layout_info": {"dtype": "float32", "num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "group_size": 32}}
    r = requests.put(bootstrap_url + "/route", json=reg)
    assert r.status_code == 200 and r.text == "OK"
    info = requests.get(bootstrap_url + q.format(-1, -1, -1, -1)).json()
    assert info["page_size"] == 1 and info["kv_cache_dtype"] == "auto" and info["dp_size"] == 1
    assert info["kv_layout_info"]["num_layers"] == 2
    rank = requests.get(bootstrap_url + q.format(0, 0, 0, 0)).json()
    assert (rank["rank_ip"], rank["rank_port"], rank["transfer_session"]) == ("10.1.1.1", 5555, "10.1.1.1:1234")
    assert requests.get(bootstrap_url + q.format(1, 0, 0, 0)).status_code == 404
    assert requests.get(bootstrap_url + "/route?prefill_dp_rank=0").status_code == 400
    assert requests.post(bootstrap_url + "/register_dp_rank", json={"bootstrap_room": 77, "dp_rank": 0}).text == "OK"
    assert requests.post(bootstrap_url + "/query_dp_ranks", json={"bootstrap_rooms": [77]}).json() == {"77": 0}


def test_auto_stream_is_chunk_on_a_paced_gpu_link_int8_unpaced_from_half_budget_and_end_otherwise():
    from sgl_kvxfer.config import ServerArgs

    def stream(b, s="auto", device="cuda", rate=0.0):
        args = ServerArgs.from_flat(kv_tier_budget=b, kv_transfer_stream=s, device=device, kv_transfer_rate_gbps=rate)
        return args.scheduler.resolved_kv_transfer_stream

    assert [stream(b) for b in (1.0, 0.75, 0.5, 0.3)] == ["end", "int8", "int8", "end"]
    assert [stream(b, rate=10) for b in (1.0, 0.75, 0.5, 0.3)] == ["end", "chunk", "chunk", "chunk"]
    assert [stream(b, device="cpu") for b in (0.75, 0.5, 0.3)] == ["end", "end", "end"]
    assert [stream(b, device="cpu", rate=10) for b in (0.5, 0.3)] == ["end", "end"]
    assert stream(0.3, "end", rate=10) == "end"
    assert stream(0.3, "int8") == "int8" and stream(0.75, "end") == "end"
    with pytest.raises(ValueError, match="kv_transfer_stream"):
        stream(0.5, "fast")


def test_last_chunk_cuts_the_final_chunk_short_for_tiered_chunk_streams_only():
    """--kv-transfer-last-chunk: a prompt whose rest is one chunk and at least twice N is cut so
    its last N tokens are a chunk of their own; other roles (N = 0) chunk as before."""
    from types import SimpleNamespace

    from sgl_kvxfer.scheduler.policy import PrefillAdder
    from sgl_kvxfer.scheduler.scheduler import Scheduler

    def chunks(prompt: int, chunk: int | None, last: int, cap: int = 0) -> list[int]:
        me = SimpleNamespace(config=SimpleNamespace(resolved_chunked_prefill_size=chunk), _role_prefill=True,
                             role=SimpleNamespace(last_chunk_tokens=lambda req: last, stream_chunk_tokens=lambda req: cap))
        out, done = [], 0
        while done < prompt:
            adm = PrefillAdder(1 << 20, chunk, 1 << 20, 8).try_add(
                prompt - done, 0, Scheduler._chunk_limit(me, None, prompt - done))
            assert adm.chunked == (done + adm.extend_len < prompt)
            out.append(adm.extend_len)
            done += adm.extend_len
        return out

    assert chunks(8192, 2048, 512) == [2048, 2048, 2048, 1536, 512]
    assert chunks(8192, 2048, 0) == [2048] * 4
    assert chunks(2048, 2048, 512) == [1536, 512]
    assert chunks(1000, 2048, 512) == [1000]  # under twice N: one chunk
    assert chunks(1024, 2048, 512) == [512, 512]
    assert chunks(4100, 2048, 512) == [2048, 2048, 4]  # a rest under 2 N stays whole
    assert chunks(8192, None, 512) == [8192]  # no chunking: nothing to cut
    assert chunks(8192, 2048, 1024) == [2048, 2048, 2048, 1024, 1024]
    assert chunks(64, 64, 32) == [32, 32]
    # a streaming cap (--kv-transfer-stream-chunk on a slow link) cuts chunks first
    assert chunks(8192, 8192, 512, cap=2048) == [2048, 2048, 2048, 1536, 512]
    assert chunks(8192, 8192, 0, cap=2048) == [2048] * 4
    assert chunks(8192, 8192, 512, cap=0) == [7680, 512]
    assert chunks(8192, 1024, 0, cap=2048) == [1024] * 8  # a cap above the chunk size changes nothing
    assert chunks(8192, None, 0, cap=2048) == [8192]  # chunking off stays off


def test_stream_chunk_caps_only_chunks_that_stream_over_a_slow_link():
    """--kv-transfer-stream-chunk: over unpaced NVLink chunks keep the chunk size; paced, RDMA or
    TCP, an untiered pool's chunks and tiered int8 / chunk streams are capped; a tiered "end"
    room, an SCD room and the fake backend never are."""
    from types import SimpleNamespace

    from sgl_kvxfer.disagg.prefill import PrefillRole
    from sgl_kvxfer.disagg.prefill_room import PrefillRoom
    from sgl_kvxfer.disagg.role import PDRole

    def cap(transport: str | None, paced: bool = False, tiered: bool = False, stream: str = "end",
            room_kind=PrefillRoom, setting: int = 2048, fake: bool = False, shaped: bool = True) -> int:
        inner = SimpleNamespace(transport=transport)
        engine = SimpleNamespace(inner=inner, paced=paced) if shaped else inner
        room = room_kind(1) if room_kind is PrefillRoom else room_kind()
        room.stream = stream
        me = SimpleNamespace(settings=SimpleNamespace(stream_chunk=setting), fake=fake, tiered=tiered,
                             engine=engine, _room_of=lambda req: room)
        return PrefillRole.stream_chunk_tokens(me, object())

    assert cap("nvlink_intra") == 0 and cap("nvlink_intra", shaped=False) == 0
    assert cap("nvlink_intra", paced=True) == 2048
    assert cap("rdma") == 2048 and cap("tcp", shaped=False) == 2048 and cap(None) == 2048
    assert [cap("rdma", tiered=True, stream=s) for s in ("end", "int8", "chunk", "chunk-upgrade")] == [0, 2048, 2048, 2048]
    assert cap("rdma", setting=0) == 0 and cap("rdma", fake=True) == 0
    assert cap("rdma", room_kind=SimpleNamespace) == 0  # not a PrefillRoom: an SCD room
    assert PDRole().stream_chunk_tokens(object()) == 0


def test_chunked_prefill_size_defaults_by_device_memory_as_sglang():
    from sgl_kvxfer.config import ServerArgs, auto_chunk_size

    assert [auto_chunk_size(g) for g in (None, 15.0, 23.6, 39.4, 47.5, 79.6, 139.8, 178.4)] == \
        [2048, 2048, 2048, 4096, 4096, 8192, 8192, 16384]
    cpu = ServerArgs.from_flat(device="cpu").scheduler
    assert cpu.chunked_prefill_size is None and cpu.resolved_chunked_prefill_size == 2048
    assert ServerArgs.from_flat(device="cpu", chunked_prefill_size=512).scheduler.resolved_chunked_prefill_size == 512
    assert ServerArgs.from_flat(device="cpu", chunked_prefill_size=-1).scheduler.resolved_chunked_prefill_size is None


def test_stream_chunk_flag_is_validated():
    from sgl_kvxfer.config import ServerArgs
    from sgl_kvxfer.server.flags import parse_server_args

    assert ServerArgs.from_flat().scheduler.kv_transfer_stream_chunk == 2048
    assert parse_server_args(["--kv-transfer-stream-chunk", "0"]).scheduler.kv_transfer_stream_chunk == 0
    for bad in (-1, 16, 1 << 21, 1.5, "2048", True):
        with pytest.raises(ValueError, match="kv_transfer_stream_chunk"):
            ServerArgs.from_flat(kv_transfer_stream_chunk=bad)
    with pytest.raises(SystemExit):
        parse_server_args(["--kv-transfer-stream-chunk", "16"])


def test_last_chunk_is_asked_for_tiered_chunk_stream_rooms_only():
    from types import SimpleNamespace

    from sgl_kvxfer.disagg.prefill import PrefillRole
    from sgl_kvxfer.disagg.role import PDRole

    def asked(tiered: bool, stream: str | None, last: int = 256) -> int:
        room = None if stream is None else SimpleNamespace(stream=stream, last_chunk=last)
        return PrefillRole.last_chunk_tokens(SimpleNamespace(tiered=tiered, _room_of=lambda req: room), object())

    assert [asked(True, s) for s in ("chunk", "chunk-upgrade", "end", "int8")] == [256, 256, 0, 0]
    assert asked(False, "chunk") == 0 and asked(True, None) == 0 and asked(True, "chunk", 0) == 0
    assert PDRole().last_chunk_tokens(object()) == 0


def test_last_chunk_flag_is_validated():
    from sgl_kvxfer.config import ServerArgs
    from sgl_kvxfer.server.flags import parse_server_args

    assert ServerArgs.from_flat().scheduler.kv_transfer_last_chunk == 512
    assert parse_server_args(["--kv-transfer-last-chunk", "0"]).scheduler.kv_transfer_last_chunk == 0
    for bad in (-1, 16, 1 << 21, 1.5, float("nan"), "512", True):
        with pytest.raises(ValueError, match="kv_transfer_last_chunk"):
            ServerArgs.from_flat(kv_transfer_last_chunk=bad)
    for bad in ("nan", "inf", "-1", "16", "2e9", "1.5", "soon"):
        with pytest.raises(SystemExit):  # argparse's error, naming the flag
            parse_server_args(["--kv-transfer-last-chunk", bad])


def test_mooncake_start_writes_nothing_to_stderr():
    """glog's pre-init notice and the handshake's own-segment lookup line are not the user's
    concern: an engine start prints nothing (disagg/mooncake.py)."""
    import subprocess
    import sys

    pytest.importorskip("mooncake.engine", exc_type=ImportError)
    code = ("from sgl_kvxfer.disagg.mooncake import MooncakeTransferEngine; import sys; "
            "e = MooncakeTransferEngine('127.0.0.1'); print(e.session_id()); print('stderr works', file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("127.0.0.1:"), out.stderr
    assert out.stderr == "stderr works\n"


# ---------------------------------------------------------------- peer liveness (disagg/peers.py)
def test_peer_monitor_sees_a_peer_die_and_come_back():
    import socket
    import time

    from sgl_kvxfer.disagg.peers import PeerMonitor, endpoint_peer

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    peer = listener.getsockname()
    assert endpoint_peer(f"tcp://{peer[0]}:{peer[1]}") == peer
    mon = PeerMonitor(interval=0.05, timeout=1.0, max_failures=2)

    def poll_until(cond, limit=10.0):
        died, deadline = [], time.monotonic() + limit
        while not cond() and time.monotonic() < deadline:
            died += mon.poll({peer})
            time.sleep(0.02)
        return died

    try:
        poll_until(lambda: False, 0.5)
        assert not mon.is_dead(peer) and mon.deaths == 0
        listener.close()  # the process is gone: connections are refused
        t0 = time.monotonic()
        died = poll_until(lambda: mon.is_dead(peer))
        assert died == [peer] and mon.deaths == 1 and "ConnectionRefusedError" in mon.describe(peer)
        assert time.monotonic() - t0 < 5.0
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(peer)
        listener.listen(8)
        poll_until(lambda: not mon.is_dead(peer))
        assert not mon.is_dead(peer)
        mon.poll(set())  # no room needs it any more: forgotten
        assert mon.describe(peer) == "never probed"
    finally:
        listener.close()
        mon.close()


def test_a_role_fails_the_rooms_of_a_peer_its_monitor_sees_die():
    """The base class's peer hooks (disagg/role.py): check_peers probes what watched_peers
    names and hands a dead peer to on_peer_dead once, counted in the role's stats."""
    import socket
    import time

    from sgl_kvxfer.disagg.common import TransferStats
    from sgl_kvxfer.disagg.peers import PeerMonitor
    from sgl_kvxfer.disagg.role import PDRole

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    peer = listener.getsockname()

    class Watcher(PDRole):
        peer_kind = "decode"

        def __init__(self):
            self.stats, self.monitor, self.dead = TransferStats(), PeerMonitor(0.05, 1.0, 2), []

        def watched_peers(self):
            return {peer: "tcp://%s:%d" % peer}

        def on_peer_dead(self, p, reason):
            self.dead.append((p, reason))

    role = Watcher()
    try:
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            role.check_peers(time.monotonic())
            time.sleep(0.02)
        assert role.dead == [] and role.stats.peer_failures == 0
        listener.close()
        deadline = time.monotonic() + 10.0
        while not role.dead and time.monotonic() < deadline:
            role.check_peers(time.monotonic())
            time.sleep(0.02)
        for _ in range(10):  # dead already: not reported again
            role.check_peers(time.monotonic())
        assert [p for p, _ in role.dead] == [peer] and role.stats.peer_failures == 1
        assert role.dead[0][1].startswith("decode unreachable: tcp://127.0.0.1:")
    finally:
        listener.close()
        role.close()
    assert PDRole().watched_peers() == {} and PDRole().check_peers(0.0) is None  # no monitor: nothing
