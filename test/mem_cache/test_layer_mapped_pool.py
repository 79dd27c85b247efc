"""LayerMappedKVPool (FusedKV): storage for the bottom layers only, over every pool family.

Same token capacity -> half the allocated bytes and half the bytes per token; the same byte
budget -> twice the tokens; the storage map, errors on reconstruction layers, delegation of
family members, and PD's stored-layer export.
"""
import dataclasses

import pytest
import torch
from fusedkv_helpers import TINY

from sgl_kvxfer.config import EngineConfig
from sgl_kvxfer.engine.memory import kv_pool_tokens
from sgl_kvxfer.mem_cache import create_kv_pool, create_slot_allocator
from sgl_kvxfer.mem_cache.layer_mapped_pool import LayerMappedKVPool
from sgl_kvxfer.mem_cache.pool_bytes import allocated_bytes
from sgl_kvxfer.models.arch_config import ModelArchConfig

ARCH = ModelArchConfig.from_hf_dict({**TINY, "num_hidden_layers": 6})
FAMILIES = {
    "fp16": dict(attention_backend="torch"),
    "paged_fp16": dict(attention_backend="torch", page_size=16),
    "tiered": dict(attention_backend="torch", kv_tier_budget=0.5, kv_quant_group_size=16, kv_tier_page_size=16),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_half_the_bytes_at_the_same_tokens(family):
    cfg = EngineConfig(**FAMILIES[family])
    vanilla = create_kv_pool(cfg, ARCH, 512, torch.float16, "cpu")
    pool = create_kv_pool(cfg, ARCH, 512, torch.float16, "cpu", stored_layers=3)
    assert isinstance(pool, LayerMappedKVPool) and pool.num_layers == 6 and pool.inner.num_layers == 3
    assert type(pool.inner) is type(vanilla) and pool.size == vanilla.size  # same token capacity
    assert allocated_bytes(pool) == allocated_bytes(vanilla) / 2
    assert pool.bytes_per_token() == vanilla.bytes_per_token() / 2
    assert pool.vanilla_bytes_per_token() == 2 * 6 * ARCH.num_key_value_heads * ARCH.head_dim * 2
    assert pool.storage_map() == [True] * 3 + [False] * 3
    assert (pool.layout, pool.drops_tokens) == (vanilla.layout, vanilla.drops_tokens)
    # the allocator of the family runs on the wrapper (delegated members)
    alloc = create_slot_allocator(cfg, pool, "cpu")
    slots = alloc.alloc(5)
    k = torch.randn(5, ARCH.num_key_value_heads, ARCH.head_dim, dtype=torch.float16)
    pool.set_kv(2, slots, k, -k)
    got_k, got_v = pool.get_kv(2, slots)
    torch.testing.assert_close(got_v, -got_k)
    if family != "tiered":
        torch.testing.assert_close(got_k, k)
    for bad in (3, 5):
        with pytest.raises(IndexError, match="stores no KV"):
            pool.set_kv(bad, slots, k, k)
        with pytest.raises(IndexError, match="stores no KV"):
            pool.get_kv(bad, slots)
    assert len(pool.read_external(slots)) == 3  # PD ships the stored layers only


def test_twice_the_tokens_at_the_same_bytes(tmp_path):
    """ModelRunner sizes the pool from the stored layers' bytes per token."""
    from sgl_kvxfer.engine.model_runner import ModelRunner, stored_layers

    est = {}
    for name, section in (("vanilla", None), ("fusedkv", {"variant": "fusedkv", "num_storage_layers": 2})):
        runner = ModelRunner.__new__(ModelRunner)  # only the sizing inputs
        runner.arch, runner.dtype = ModelArchConfig.from_hf_dict(TINY), torch.float16
        runner.stored_layers = stored_layers({**TINY, **({"fusedkv": section} if section else {})})
        est[name] = runner._bytes_per_token_estimate()
    assert est["fusedkv"] == est["vanilla"] / 2
    budget_tokens = {n: kv_pool_tokens("cpu", 0.001, 0, b, None) for n, b in est.items()}
    assert budget_tokens["fusedkv"] in (2 * budget_tokens["vanilla"], 2 * budget_tokens["vanilla"] + 1)


def test_storage_layers_must_fit():
    cfg = EngineConfig(attention_backend="torch")
    inner = create_kv_pool(cfg, dataclasses.replace(ARCH, num_hidden_layers=4), 64, torch.float16, "cpu")
    with pytest.raises(ValueError, match="stores 1 .. 3 layers"):
        LayerMappedKVPool(inner, 3)
    # stored_layers == num_hidden_layers is a vanilla pool
    assert not isinstance(create_kv_pool(cfg, ARCH, 64, torch.float16, "cpu", stored_layers=6), LayerMappedKVPool)


@pytest.mark.parametrize("dst_family", ["fp16", "tiered"])
def test_pd_segment_carries_the_stored_layers(dst_family):
    """pack_segment / unpack_segment between FusedKV pools: the payload holds the 3 stored layers
    only; fp16 tokens arrive exactly, int8 wire tokens within the codec's error."""
    from sgl_kvxfer.mem_cache.kv_payload import pack_segment, segment_layout, unpack_segment
    from sgl_kvxfer.spectrum.tiers import TIER_FP16, TIER_INT8

    src = create_kv_pool(EngineConfig(**FAMILIES["fp16"]), ARCH, 256, torch.float16, "cpu", stored_layers=3)
    cfg = EngineConfig(**FAMILIES[dst_family])
    dst = create_kv_pool(cfg, ARCH, 256, torch.float16, "cpu", stored_layers=3)
    g = torch.Generator().manual_seed(0)
    slots = torch.arange(1, 21)
    for layer in range(3):
        k, v = (torch.randn(20, ARCH.num_key_value_heads, ARCH.head_dim, generator=g).half() for _ in range(2))
        src.set_kv(layer, slots, k, v)
    wire = torch.tensor([TIER_FP16] * 12 + [TIER_INT8] * 8, dtype=torch.int8)
    lens = (12, 8, 0)
    lay = segment_layout(src, lens)
    assert lay.num_layers == 3
    out = torch.empty(lay.total_bytes, dtype=torch.uint8)
    pack_segment(src, slots, wire, out)
    alloc = create_slot_allocator(cfg, dst, "cpu")
    d16 = alloc.alloc(12)
    d8 = alloc.alloc_tier(TIER_INT8, 8) if dst_family == "tiered" else alloc.alloc(8)
    unpack_segment(dst, out, lens, (d16, d8, torch.empty(0, dtype=torch.int64)))
    for layer in range(3):
        k, v = src.get_kv(layer, slots)
        k16, v16 = dst.get_kv(layer, d16)
        torch.testing.assert_close(k16, k[:12], atol=0, rtol=0)
        torch.testing.assert_close(v16, v[:12], atol=0, rtol=0)
        k8, _ = dst.get_kv(layer, d8)
        assert (k8.float() - k[12:].float()).abs().max() < 0.05


@pytest.mark.parametrize("family,gather", [("fp16", False), ("paged_fp16", False), ("tiered", False),
                                           ("tiered", True)])
def test_no_sync_read_matches_get_kv(family, gather):
    """get_kv_no_sync (FusedKV's torch reconstruction inside a decode graph) returns what get_kv
    does, for ids of every store of the family: fp16 rows, int8 and int4 pages, dropped (0);
    tiered: the torch form and the gather kernel (CUDA's; here under the Triton interpreter)."""
    from sgl_kvxfer.spectrum.tiers import TIER_INT4, TIER_INT8

    cfg = EngineConfig(**FAMILIES[family])
    pool = create_kv_pool(cfg, ARCH, 512, torch.float16, "cpu", stored_layers=3)
    if family == "tiered":
        assert pool.inner._fused_gather is False  # CPU: the torch form unless asked
        pool.inner._fused_gather = gather
    ids = [1, 2, 3, 7]
    if family == "tiered":
        assert pool.num_pages(TIER_INT8) and pool.num_pages(TIER_INT4)
        ids += [pool.base(TIER_INT8) + j for j in (0, 1, 17)] + [pool.base(TIER_INT4) + j for j in (0, 5, 16)]
    slots = torch.tensor(ids)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(len(ids), ARCH.num_key_value_heads, ARCH.head_dim, generator=gen).half()
    pool.set_kv(1, slots, k, 2 * k)
    read = torch.tensor([[0, *ids[:3]], ids[-4:]])  # [2, 4] with a dropped token
    want, got = pool.get_kv(1, read), pool.get_kv_no_sync(1, read)
    for w, g in zip(want, got):
        assert g.shape == (2, 4, ARCH.num_key_value_heads, ARCH.head_dim)
        # the kernel's fp32 multiply-add may round once where torch rounds twice
        torch.testing.assert_close(g, w, rtol=1e-3 if gather else 0, atol=1e-3 if gather else 0)
    with pytest.raises(IndexError, match="stores no KV"):
        pool.get_kv_no_sync(4, read)


def test_fusedkv_decode_graphs_over_every_family():
    """FusedKV's torch reconstruction path is graph-safe over every pool family: its decode reads
    through get_kv_no_sync (a tiered pool's get_kv syncs with the host, and capturing it failed
    with cudaErrorStreamCaptureUnsupported)."""
    from types import SimpleNamespace

    from sgl_kvxfer.layers.attention import fusedkv_backend
    from sgl_kvxfer.layers.attention.fusedkv_backend import FusedKVAttentionBackend
    from sgl_kvxfer.spectrum.tiers import TIER_INT4, TIER_INT8

    backends = {}
    for family in FAMILIES:
        pool = create_kv_pool(EngineConfig(**FAMILIES[family]), ARCH, 512, torch.float32, "cpu", stored_layers=3)
        backends[family] = FusedKVAttentionBackend(SimpleNamespace(supports_cuda_graph=True), pool,
                                                   ARCH.num_attention_heads, ARCH.num_key_value_heads, ARCH.head_dim)
        assert backends[family].path == "torch"  # float32: the kernels do not apply
        assert backends[family].supports_cuda_graph
    # over the tiered pool, a decode step never reaches the host-syncing get_kv
    backend = backends["tiered"]
    pool = backend.kv_pool

    def no_host_split(*args):
        raise AssertionError("decode read through get_kv")

    pool.inner.get_kv = no_host_split
    slots = torch.tensor([[1, 2, 0, pool.base(TIER_INT8)], [3, pool.base(TIER_INT4), 0, 0]])
    backend._plan = fusedkv_backend._TorchDecode(slots, (slots != 0)[:, None, None, :])
    q = torch.randn(2, ARCH.num_attention_heads, ARCH.head_dim)
    out = backend.forward_reconstruct(q, 4, None, SimpleNamespace(sources=(0, 2), lite=True))
    assert out.shape == q.shape and torch.isfinite(out).all()
