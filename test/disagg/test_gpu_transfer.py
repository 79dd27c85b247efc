"""The CUDA paths of PD transfer: device checksums, GPU-resident transfer buffers, a segment
packed on one GPU and written by Mooncake's CUDA build into another GPU's staging memory
(MC_INTRANODE_NVLINK), and --base-gpu-id. CPU twins of the logic are in test_pd_units.py."""
from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch

from sgl_kvxfer.disagg.buffers import TransferBuffer, first_bad_block, wsum64, wsum64_async, wsum64_values

pytestmark = pytest.mark.gpu

needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


def test_wsum64_on_the_gpu_equals_the_cpu():
    data = torch.randint(0, 256, ((4 << 20) * 3 + 4101,), dtype=torch.uint8)
    assert wsum64(data.cuda()) == wsum64(data)
    bad = data.cuda()
    bad[(4 << 20) + 17] ^= 0x40
    assert first_bad_block(bad, wsum64(data), "wsum64", 4 << 20) == 1


def test_wsum64_async_equals_wsum64_once_its_event_completes():
    """The pack's checksums launched without a host wait: the sender thread reads them after
    the event (a payload still being written by queued kernels when it is launched)."""
    data = torch.randint(0, 256, ((4 << 20) * 2 + 333,), dtype=torch.uint8)
    dev = torch.zeros_like(data, device="cuda")
    torch.cuda._sleep(50_000_000)  # queued work ahead of the copy: nothing may read early
    dev.copy_(data.cuda(non_blocking=True))
    host, done = wsum64_async(dev)
    assert done is not None and host.device.type == "cpu"
    done.synchronize()
    assert wsum64_values(host) == wsum64(data)


def test_transfer_buffer_lives_on_the_gpu_with_a_gpu_engine(monkeypatch):
    monkeypatch.delenv("SGL_KVXFER_KV_BUFFER", raising=False)
    buf = TransferBuffer(1 << 20, "cuda", gpu_capable_engine=True)
    assert buf.on_device and buf.tensor.is_cuda and buf.checksum_kind == "wsum64"
    host = TransferBuffer(1 << 20, "cuda", gpu_capable_engine=False)
    assert not host.on_device and host.tensor.is_pinned() and host.checksum_kind == "xxh3"
    monkeypatch.setenv("SGL_KVXFER_KV_BUFFER", "host")
    assert not TransferBuffer(1 << 20, "cuda", gpu_capable_engine=True).on_device


def _peer(rank: int, q_out, q_in, results) -> None:
    """Rank 0 packs a segment of random KV into its GPU send buffer and writes it into rank 1's
    GPU staging buffer through Mooncake; rank 1 checks the bytes by their device checksum."""
    os.environ["MC_INTRANODE_NVLINK"] = "true"
    torch.cuda.set_device(rank)
    from sgl_kvxfer.disagg.mooncake import MooncakeTransferEngine

    engine = MooncakeTransferEngine("127.0.0.1", gpu_id=rank)
    buf = TransferBuffer(64 << 20, "cuda", engine.gpu_memory)
    engine.register(buf.data_ptr(), buf.numel())
    q_out.put((engine.session_id(), buf.data_ptr(), engine.gpu_memory))
    peer_session, peer_addr, _ = q_in.get(timeout=120)
    n = (48 << 20) + 12
    if rank == 0:
        buf[:n].copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda"))
        sums = wsum64(buf[:n])
        engine.write(peer_session, buf.data_ptr(), peer_addr + 4096, n)
        q_out.put(sums)
        results.put((rank, {"sums": sums, "describe": engine.describe()}))
    else:
        sums = q_in.get(timeout=120)
        results.put((rank, {"bad": first_bad_block(buf[4096:4096 + n], sums, "wsum64", 4 << 20),
                            "on_device": buf.on_device}))


@needs_two
def test_mooncake_writes_gpu0_memory_into_gpu1_memory():
    from sgl_kvxfer.disagg.mooncake import build_has_cuda

    if not build_has_cuda():
        pytest.skip("Mooncake's CUDA build is not installed (mooncake-transfer-engine-cuda13)")
    ctx = mp.get_context("spawn")
    a, b, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_peer, args=(0, a, b, results)), ctx.Process(target=_peer, args=(1, b, a, results))]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=180) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert got[1]["on_device"] and got[1]["bad"] is None, got
    assert got[0]["describe"]["expected_transport"] == "nvlink_intra"


def test_segment_packs_into_and_unpacks_from_gpu_buffers():
    """Tiered pools on the GPU: a segment at its stored tiers packed into a device transfer
    buffer and unpacked into a second pool arrives bit for bit, and its device checksums hold."""
    from sgl_kvxfer.mem_cache.kv_payload import pack_segment, tier_counts, unpack_segment, wire_tier_of
    from sgl_kvxfer.mem_cache.tier_plan import TierStorePlan
    from sgl_kvxfer.mem_cache.tiered_allocator import TieredSlotAllocator
    from sgl_kvxfer.mem_cache.tiered_pool import TieredKVPool
    from sgl_kvxfer.spectrum.tiers import TIER_DROP, TIER_INT4, TIER_INT8

    def tiered():
        pool = TieredKVPool(256, 4, 2, 64, torch.float16, "cuda", TierStorePlan(128, 128, 128), group_size=64,
                            page_size=16)
        return pool, TieredSlotAllocator(pool, "cuda")

    src, sa = tiered()
    n = 40
    slots = sa.alloc(n)
    for layer in range(4):
        src.set_kv(layer, slots, torch.randn(n, 2, 64, device="cuda").half(), torch.randn(n, 2, 64, device="cuda").half())
    slots, _ = sa.retier(slots, torch.tensor(([0, 1, 2] * 14)[:n], dtype=torch.int8))
    wire = wire_tier_of(src, slots)
    live = wire != TIER_DROP
    buf = TransferBuffer(8 << 20, "cuda", gpu_capable_engine=True)
    lay = pack_segment(src, slots[live.to(slots.device)], wire[live], buf[:])
    payload = buf[:lay.total_bytes]
    sums = wsum64(payload)
    dst, da = tiered()
    lens = tier_counts(wire[live])
    got = (da.alloc(lens[0]), da.alloc_tier(TIER_INT8, lens[1]), da.alloc_tier(TIER_INT4, lens[2]))
    unpack_segment(dst, payload, lay.lens, got)
    assert first_bad_block(payload, sums, "wsum64", 4 << 20) is None
    for layer in range(4):
        for t in (TIER_INT8, TIER_INT4):
            sent = src.stored_codes(layer, t, slots[(wire == t).to(slots.device)])
            landed = dst.stored_codes(layer, t, got[t])
            assert all(torch.equal(a, b) for a, b in zip(sent, landed))
        sent16 = src.get_kv(layer, slots[(wire == 0).to(slots.device)])
        assert all(torch.equal(a, b) for a, b in zip(sent16, dst.get_kv(layer, got[0])))


@needs_two
def test_base_gpu_id_puts_the_engine_on_that_gpu():
    import tempfile

    from sgl_kvxfer.config import EngineConfig
    from sgl_kvxfer.engine.model_runner import ModelRunner
    from sgl_kvxfer.models.presets import write_dummy_tokenizer, write_preset_config

    try:
        with tempfile.TemporaryDirectory() as d:
            write_dummy_tokenizer(write_preset_config("tiny", d), 512)
            cfg = dict(model_path=d, load_format="dummy", device="cuda", max_total_tokens=1024, disable_cuda_graph=True)
            runner = ModelRunner(EngineConfig(base_gpu_id=1, **cfg), 4)
            assert torch.cuda.current_device() == 1
            assert next(runner.model.parameters()).device == torch.device("cuda", 1)
            with pytest.raises(ValueError, match="base-gpu-id"):
                ModelRunner(EngineConfig(base_gpu_id=torch.cuda.device_count(), **cfg), 4)
    finally:
        torch.cuda.set_device(0)


@pytest.mark.parametrize("host_out", [False, True])
def test_pack_segment_on_the_gpu_equals_the_reference(host_out):
    """The batched pack on a CUDA pool writes the bytes of the layer-by-layer reference, into a
    GPU payload or (staged) a pinned host one: stored tiers, fp16 tokens quantized on the way,
    a tier mixing both, and fp16-held tokens only (a chunk stream's segment: all layers at once)."""
    from sgl_kvxfer.mem_cache.kv_payload import pack_segment, pack_segment_reference, segment_layout, tier_counts
    from sgl_kvxfer.mem_cache.tier_plan import TierStorePlan
    from sgl_kvxfer.mem_cache.tiered_allocator import TieredSlotAllocator
    from sgl_kvxfer.mem_cache.tiered_pool import TieredKVPool

    L, H, D, n = 4, 8, 128, 300
    pool = TieredKVPool(4096, L, H, D, torch.bfloat16, "cuda", TierStorePlan(1024, 1024, 1024), group_size=32,
                        page_size=64)
    alloc = TieredSlotAllocator(pool, "cpu")
    slots = alloc.alloc(n)
    gen = torch.Generator().manual_seed(0)
    for layer in range(L):
        pool.set_kv(layer, slots.cuda(), torch.randn(n, H, D, generator=gen).cuda(),
                    torch.randn(n, H, D, generator=gen).cuda())
    half = torch.randint(0, 3, (n // 2,), generator=gen, dtype=torch.int8)
    tiered, _ = alloc.retier(slots[: n // 2], half)  # the first half at stored tiers, the rest fp16
    mixed, fresh = torch.cat([tiered, slots[n // 2:]]), slots[n // 2:]
    for ids, wire in ((mixed, torch.randint(0, 3, (n,), generator=gen, dtype=torch.int8)),
                      (mixed, torch.full((n,), 1, dtype=torch.int8)),
                      (fresh, torch.randint(0, 3, (fresh.numel(),), generator=gen, dtype=torch.int8))):
        nbytes = segment_layout(pool, tier_counts(wire)).total_bytes
        fast = torch.zeros(nbytes, dtype=torch.uint8, device="cpu" if host_out else "cuda")
        if host_out:
            fast = fast.pin_memory()
        ref = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
        pack_segment(pool, ids, wire, fast)
        pack_segment_reference(pool, ids.cuda(), wire, ref)
        torch.cuda.synchronize()
        assert torch.equal(fast.cpu(), ref.cpu())
