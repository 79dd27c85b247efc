"""--attention-backend triton over SpectrumKV's TieredKVPool (paged int stores, filled tables).

1. tier_block_tables: req_to_token rows -> per-tier pages + fills (drops and stale columns out).
2. Backend decode on a hand-built tiered pool (mixed tiers, dropped tokens, two requests of
   different lengths, GQA) against the torch backend reading the same pool.
3. Engine: tiny dummy Llama in bf16, budget 0.5, triton vs torch at the same budget: extend
   (extend_attention_tiered over filled prefix tables, radix hits over int8/int4 prefixes
   included) and decode (tiered_pool_decode) against the torch backend's get_kv + SDPA.
On CPU the kernel runs under TRITON_INTERPRET=1 (test/conftest.py); bf16 dots run in fp32 there.
"""
import random
import sys

import pytest
import torch

from sgl_kvxfer.forward_batch import ForwardBatch, ForwardMode
from sgl_kvxfer.layers.attention import create_attention_backend
from sgl_kvxfer.mem_cache.tier_plan import TierStorePlan
from sgl_kvxfer.mem_cache.tiered_allocator import TieredSlotAllocator
from sgl_kvxfer.mem_cache.tiered_pool import TieredKVPool
from sgl_kvxfer.mem_cache.tiered_rows import tier_block_tables
from sgl_kvxfer.spectrum.tiers import TIER_DROP, TIER_FP16, TIER_INT4, TIER_INT8

from greedy_checks import assert_greedy_close
from tiny_models import tiny_llama

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LAYERS, HQ, HKV, D, G, PAGE = 2, 4, 2, 32, 16, 16


def _pool(dtype, n16=40, n8=32, n4=32):
    pool = TieredKVPool(64, LAYERS, HKV, D, dtype, DEVICE, TierStorePlan(n16, n8, n4), group_size=G, page_size=PAGE)
    return pool, TieredSlotAllocator(pool, DEVICE)


def test_block_tables_group_by_tier_and_skip_drops_and_stale_columns():
    pool, alloc = _pool(torch.float16)
    slots = alloc.alloc(9)
    new, _ = alloc.retier(slots, torch.tensor([0, 1, 2, 3, 1, 0, 2, 2, 1], dtype=torch.int8))
    table = torch.zeros((2, 12), dtype=torch.int64, device=DEVICE)
    table[0, :9] = new
    table[0, 9:] = slots[0]  # stale column past seq_len: ignored
    table[1, :3] = new[:3]  # a second holder sees a prefix of the run (radix sharing)
    seq_lens = torch.tensor([9, 3], device=DEVICE)
    tables = tier_block_tables(pool, table, seq_lens)
    tiers = pool.tier_of(new).cpu()
    for b, (lo, n) in enumerate(((0, 9), (0, 3))):
        ids = new[lo:lo + n].cpu()
        for t in (TIER_FP16, TIER_INT8, TIER_INT4):
            held = ids[tiers[lo:lo + n] == t]
            assert int(tables.lens[t][b]) == held.numel(), (b, t)
            if t == TIER_FP16:
                assert sorted(tables.tables[t][b, :held.numel()].tolist()) == sorted(held.tolist())
                continue
            pages, offs = pool.page_offset(t, held)
            npg = int(tables.num_pages[t][b])
            assert tables.tables[t][b, :npg].tolist() == sorted(set(pages.tolist()))
            assert tables.fills[t][b, :npg].tolist() == [int((pages == p).sum()) for p in sorted(set(pages.tolist()))]
            assert sorted(offs.tolist()) == sorted(o for p in set(pages.tolist()) for o in range(int((pages == p).sum())))
    assert int(tables.total_lens()[0]) == 8  # the dropped token is not a key
    assert tables.filled and all(x.dtype == torch.int32 for x in tables.tables + tables.lens + tables.fills)


def _decode_batch(table, rows, lens, new_slots):
    B = len(lens)
    return ForwardBatch(
        mode=ForwardMode.DECODE, input_ids=torch.zeros(B, dtype=torch.int64, device=DEVICE),
        positions=torch.tensor([n - 1 for n in lens], device=DEVICE), out_cache_loc=new_slots,
        req_pool_indices=torch.tensor(rows, device=DEVICE), seq_lens=torch.tensor(lens, device=DEVICE),
        extend_prefix_lens=[n - 1 for n in lens], extend_seq_lens=[1] * B, seq_lens_cpu=list(lens),
        logits_positions=torch.arange(B, device=DEVICE), req_to_token=table)


@pytest.mark.parametrize("dtype,atol", [(torch.float16, 4e-3), (torch.bfloat16, 1.6e-2)])
def test_backend_decode_matches_torch_on_tiered_pool(dtype, atol):
    pool, alloc = _pool(dtype)
    gen = torch.Generator().manual_seed(0)
    lens, rows = [23, 9], [2, 0]
    table = torch.zeros((3, 32), dtype=torch.int64, device=DEVICE)
    tier_choice = torch.tensor([TIER_FP16, TIER_INT8, TIER_INT4, TIER_DROP])
    new_kv = []
    for n, row in zip(lens, rows):
        slots = alloc.alloc(n)
        for layer in range(LAYERS):
            k, v = (torch.randn(n, HKV, D, generator=gen).to(dtype).to(DEVICE) for _ in range(2))
            pool.set_kv(layer, slots, k, v)
        asked = tier_choice[torch.randint(0, 4, (n - 1,), generator=gen)].to(torch.int8)
        moved, _ = alloc.retier(slots[:-1], asked)  # the newest token stays fp16 (written by forward)
        table[row, :n] = torch.cat([moved, slots[-1:]])
        new_kv.append([pool.get_kv(layer, slots[-1:]) for layer in range(LAYERS)])
    assert alloc.used_counts()[TIER_INT8] and alloc.used_counts()[TIER_INT4]
    assert (table == 0).sum() > 3 * 32 - sum(lens)  # some dropped tokens inside the rows
    new_slots = table[rows, [n - 1 for n in lens]]
    kw = dict(kv_pool=pool, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D)
    triton_b, torch_b = create_attention_backend("triton", **kw), create_attention_backend("torch", **kw)
    assert type(triton_b).__name__ == "TritonTieredAttentionBackend"
    for layer in range(LAYERS):
        q = torch.randn(len(lens), HQ, D, generator=gen).to(dtype).to(DEVICE)
        k = torch.cat([kv[layer][0] for kv in new_kv])
        v = torch.cat([kv[layer][1] for kv in new_kv])
        out = {}
        for name, backend in (("triton", triton_b), ("torch", torch_b)):
            batch = _decode_batch(table, rows, lens, new_slots)
            backend.prepare_metadata(batch)
            out[name] = backend.forward(q, k, v, layer, batch).float()
        torch.testing.assert_close(out["triton"], out["torch"], atol=atol, rtol=0)


# ---------------------------------------------------------------------------------------- engine
TINY = tiny_llama(torch_dtype="bfloat16")
ATOL = 5e-2  # logprobs: bf16 activations, different attention summation orders


@pytest.mark.heavy  # over 10 s on 2 cores: CI leaves it out (README, Tests)
def test_engine_triton_matches_torch_at_budget_half(tiny_dir):
    from sgl_kvxfer import Engine
    from sgl_kvxfer.config import EngineConfig

    cfg = EngineConfig(attention_backend="triton", kv_tier_budget=0.5)
    assert cfg.resolved_page_size == 1 and cfg.resolved_attention_backend == "triton"
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (70, 33, 120)]
    # radix hits: each prompt again plus new tokens, extended over its cached int8/int4 prefix
    hits = [p + [rng.randrange(3, 256) for _ in range(9)] for p in prompts]
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    out = {}
    for backend in ("torch", "triton"):
        with Engine(tiny_dir, load_format="dummy", dtype="bfloat16", device=DEVICE, attention_backend=backend,
                    kv_tier_budget=0.5, kv_int4="on", kv_decode_recent=4, kv_quant_group_size=G,
                    max_total_tokens=2048, chunked_prefill_size=64) as eng:
            assert type(eng.runner.attn_backend).__name__ == (
                "TritonTieredAttentionBackend" if backend == "triton" else "TorchAttentionBackend")
            out[backend] = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True,
                                        top_logprobs_num=2)
            used = eng.runner.allocator.used_counts()  # the radix cache still holds the tiered tokens
            assert used[TIER_INT8] > 30 and used[TIER_INT4] > 30, used
            out[backend] += eng.generate(input_ids=hits, sampling_params=params, return_logprob=True,
                                         top_logprobs_num=2)
            assert all(o["meta_info"]["cached_tokens"] >= 32 for o in out[backend][len(prompts):])
            eng.runner.allocator.debug_check()
    n = len(prompts)
    assert_greedy_close(out["triton"][:n], out["torch"][:n], ATOL)
    assert sum(o["output_ids"] == r["output_ids"] for o, r in zip(out["triton"], out["torch"])) >= 2
    # radix hits: the first token comes from the extend over the cached int8/int4 prefix. Later
    # steps are not compared: the two backends' extends round the new tokens' deeper-layer KV
    # differently (bf16), the decode demotions quantize those slightly different values, and on
    # this random tiny model the flipped codes grow to ~0.2 nats within a few steps.
    for g, r in zip(out["triton"][n:], out["torch"][n:]):
        gl, rl = g["meta_info"]["output_token_logprobs"], r["meta_info"]["output_token_logprobs"]
        assert g["output_ids"][0] == r["output_ids"][0] and abs(gl[0][0] - rl[0][0]) < ATOL


@pytest.mark.heavy  # about a minute under the interpreter on 2 cores: CI leaves it out (README, Tests)
def test_fused_rope_store_into_fp16_rows_matches_unfused(tiny_dir, monkeypatch):
    """forward_qkv's fused RoPE + store into the tiered pool's fp16 rows (kernels/rope_store.py
    over the rows viewed as pages of one token), forced on under the interpreter by treating CPU
    as CUDA: chunked prefill, re-tiering, a radix hit over int8/int4 prefixes and decode
    demotions give the unfused path's tokens and logprobs."""
    from sgl_kvxfer import Engine
    from sgl_kvxfer.kernels import rope_store
    from sgl_kvxfer.layers import fused_ops

    rng = random.Random(11)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (70, 40)]
    hit = prompts[0] + [rng.randrange(3, 256) for _ in range(5)]
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    out, calls = {}, []
    real_wants, real_store = fused_ops.wants_fused, rope_store.rope_store_kv
    for fused in (False, True):
        monkeypatch.setenv("SGL_KVXFER_FUSED_ELEMENTWISE", "1" if fused else "0")
        if fused:
            monkeypatch.setattr(fused_ops, "wants_fused", lambda dev, dt: real_wants("cuda" if dev == "cpu" else dev, dt))
            monkeypatch.setattr(rope_store, "rope_store_kv", lambda *a, **kw: calls.append(kw) or real_store(*a, **kw))
        with Engine(tiny_dir, load_format="dummy", dtype="bfloat16", device=DEVICE, attention_backend="triton",
                    kv_tier_budget=0.5, kv_int4="on", kv_decode_recent=4, kv_quant_group_size=G,
                    max_total_tokens=2048, chunked_prefill_size=32) as eng:
            kw = dict(sampling_params=params, return_logprob=True, top_logprobs_num=2)
            out[fused] = eng.generate(input_ids=prompts, **kw) + eng.generate(input_ids=[hit], **kw)
            assert out[fused][-1]["meta_info"]["cached_tokens"] >= 32
            eng.runner.allocator.debug_check()
    assert any(c["return_kv"] for c in calls) and any(not c["return_kv"] for c in calls)  # extend and decode
    assert_greedy_close(out[True], out[False], ATOL)
    for g, r in zip(out[True], out[False]):
        assert g["output_ids"][0] == r["output_ids"][0]
        assert abs(g["meta_info"]["output_token_logprobs"][0][0] - r["meta_info"]["output_token_logprobs"][0][0]) < ATOL


@pytest.mark.gpu
def test_gpu_smollm2_shape_tiered_triton_vs_torch(tmp_path):
    """SmolLM2-shaped dummy model (9 q / 3 kv heads, D 64, 30 layers), bf16, budget 0.5 on GPU."""
    from sgl_kvxfer import Engine
    from sgl_kvxfer.models.presets import PRESETS, write_dummy_tokenizer, write_preset_config

    model_dir = write_preset_config("smollm2-135m", str(tmp_path / "smol"))
    write_dummy_tokenizer(model_dir, PRESETS["smollm2-135m"]["vocab_size"])
    rng = random.Random(3)
    prompts = [[rng.randrange(10, 49152) for _ in range(n)] for n in (300, 700, 150, 1200)]
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    out = {}
    for backend in ("torch", "triton"):
        with Engine(model_dir, load_format="dummy", dtype="bfloat16", attention_backend=backend, kv_tier_budget=0.5,
                    kv_int4="on", kv_decode_recent=8, max_total_tokens=16384, chunked_prefill_size=256) as eng:
            out[backend] = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True,
                                        top_logprobs_num=2)
            used = eng.runner.allocator.used_counts()
            assert used[TIER_INT8] > 1000 and used[TIER_INT4] > 300, used
    assert_greedy_close(out["triton"], out["torch"], 0.1)


@pytest.mark.heavy  # about a minute under the interpreter on 2 cores: CI leaves it out (README, Tests)
def test_engine_static_graph_path_matches_eager_on_tiered_pool(tiny_dir):
    """The CUDA-graph capture target (CudaGraphRunner.decode_step_static, eager replay on CPU)
    over the tiered pool: fixed-width filled tables, padding rows on the scratch slot, retiering
    between steps. Greedy outputs and logprobs equal the eager decode's."""
    from sgl_kvxfer import Engine
    from sgl_kvxfer.engine.cuda_graph_runner import CudaGraphRunner

    rng = random.Random(11)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (40, 70, 21)]
    params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in (9, 5, 12)]
    with Engine(tiny_dir, load_format="dummy", dtype="bfloat16", device=DEVICE, attention_backend="triton",
                kv_tier_budget=0.5, kv_int4="on", kv_decode_recent=4, kv_tier_page_size=16,
                max_total_tokens=2048, max_running_requests=4, disable_cuda_graph=True) as eng:
        runner = eng.runner
        assert runner.attn_backend.supports_cuda_graph or DEVICE == "cuda"
        assert runner.kv_pool.group_size == D and runner.kv_pool.page_size == 16  # G default: head_dim
        eager = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        eng.flush_cache()
        static = CudaGraphRunner(runner, max_bs=4, use_graphs=False)
        runner.graph_runner = static
        graphed = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        assert static.replays == 11  # decode steps: the longest request samples 12 tokens, one at prefill
        assert not runner.kv_pool.k16[0][0].any(), "the padding row must stay zero"
        used = runner.allocator.used_counts()
        assert used[TIER_INT8] and used[TIER_INT4]
        eng.flush_cache()
        runner.allocator.debug_check()
    for e, g in zip(eager, graphed):
        assert e["output_ids"] == g["output_ids"]
        el, gl = e["meta_info"]["output_token_logprobs"], g["meta_info"]["output_token_logprobs"]
        assert max(abs(a[0] - b[0]) for a, b in zip(el, gl)) < 1e-3


@pytest.mark.gpu
def test_gpu_tiered_graphs_match_eager(tiny_dir):
    """Tiered decode replayed from CUDA graphs vs
    --disable-cuda-graph, at budget 0.5."""
    from sgl_kvxfer import Engine

    rng = random.Random(5)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(20, 400))] for _ in range(10)]
    params = [{"max_new_tokens": 8 + 4 * i, "temperature": 0, "ignore_eos": True} for i in range(10)]
    out = {}
    for graphs in (True, False):
        with Engine(tiny_dir, load_format="dummy", dtype="bfloat16", attention_backend="triton",
                    kv_tier_budget=0.5, kv_int4="on", kv_decode_recent=16, max_total_tokens=16384,
                    max_running_requests=16, cuda_graph_max_bs=8, disable_cuda_graph=not graphs) as eng:
            runner = eng.runner
            assert (runner.graph_runner is not None) == graphs
            out[graphs] = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True,
                                       top_logprobs_num=2)
            if graphs:
                assert runner.graph_runner.replays > 20
    assert_greedy_close(out[True], out[False], 0.1)


def test_engine_kernel_paths_wired_with_references(tiny_dir, monkeypatch):
    """The backend's kernel paths, with the kernels replaced by their torch references over the same arguments: prefix tables, qo_indptr, the new tokens at full precision
    and importance capture from pool.get_kv. Same tokens as the torch backend at budget 0.5."""
    from sgl_kvxfer import Engine
    from sgl_kvxfer.kernels import extend_attention, tiered_pool_decode

    calls = {"decode": 0, "extend": 0}

    def decode_ref(q, layer, tables, sm_scale=None, out=None, **_):
        calls["decode"] += 1
        assert tables.filled and not layer.uniform_pages
        return tiered_pool_decode.tiered_pool_decode_reference(q, layer, tables, sm_scale)

    def extend_ref(q, k, v, qo_indptr, layer, tables, sm_scale=None, max_extend_len=None, **_):
        calls["extend"] += 1
        return extend_attention.extend_attention_tiered_reference(q, k, v, qo_indptr, layer, tables, sm_scale)

    monkeypatch.setattr(tiered_pool_decode, "tiered_pool_decode", decode_ref)
    monkeypatch.setattr(extend_attention, "extend_attention_tiered", extend_ref)
    rng = random.Random(7)
    stem = [rng.randrange(3, 256) for _ in range(50)]
    prompts = [stem + [rng.randrange(3, 256) for _ in range(n)] for n in (20, 1, 70)]  # radix hits
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    out, records = {}, {}
    for backend in ("torch", "triton"):
        with Engine(tiny_dir, load_format="dummy", dtype="bfloat16", device=DEVICE, attention_backend=backend,
                    kv_tier_budget=0.5, kv_int4="on", kv_decode_recent=4, kv_tier_page_size=16,
                    max_total_tokens=2048, chunked_prefill_size=32, disable_cuda_graph=True) as eng:
            out[backend] = [eng.generate(input_ids=p, sampling_params=params, return_logprob=True) for p in prompts]
            records[backend] = [(r.start, r.end, r.got) for r in eng.scheduler.tiering.records]
    assert calls["decode"] and calls["extend"]
    # the same tiers: importance capture (attn_observer) saw the same queries and keys
    assert records["triton"] == records["torch"] and len(records["torch"]) > 3
    for g, r in zip(out["triton"], out["torch"]):
        assert g["output_ids"] == r["output_ids"]
        gl, rl = g["meta_info"]["output_token_logprobs"], r["meta_info"]["output_token_logprobs"]
        assert max(abs(a[0] - b[0]) for a, b in zip(gl, rl)) < ATOL


def test_fp16_route_reads_the_same_keys_as_route():
    pool, alloc = _pool(torch.float32)
    slots = alloc.alloc(12)
    pool.set_kv_fp16(0, slots, torch.randn(12, HKV, D), torch.randn(12, HKV, D))
    row = slots.view(3, 4)
    a, b = pool.get_k_routed(0, pool.route(row)), pool.get_k_routed(0, pool.fp16_route(row))
    assert a.shape == b.shape == (3, 4, HKV, D) and torch.equal(a, b)


def test_observer_routes_a_prompts_own_row_on_the_device_and_a_cached_prefix_through_the_host(tiny_dir, monkeypatch):
    """Importance capture's key route: a prompt with no cached prefix (every id its own, fp16
    until its re-tier) is routed without reading its row back; one behind a radix hit (cached
    ids may be int ids) reads it back once per forward."""
    from sgl_kvxfer import Engine

    calls = {"route": 0, "fp16_route": 0}
    for name in calls:
        plain = getattr(TieredKVPool, name)

        def counted(self, slots, _plain=plain, _name=name):
            if sys._getframe(1).f_code.co_name == "_extend_kernel_path":  # the observer's (retier routes too)
                calls[_name] += 1
            return _plain(self, slots)

        monkeypatch.setattr(TieredKVPool, name, counted)
    rng = random.Random(3)
    stem = [rng.randrange(3, 256) for _ in range(40)]
    params = {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}
    with Engine(tiny_dir, load_format="dummy", dtype="bfloat16", device=DEVICE, attention_backend="triton",
                kv_tier_budget=0.5, kv_int4="on", kv_tier_page_size=16, max_total_tokens=2048,
                chunked_prefill_size=32, disable_cuda_graph=True) as eng:
        eng.generate(input_ids=stem + [7] * 30, sampling_params=params)
        own = dict(calls)
        eng.generate(input_ids=stem + [9] * 30, sampling_params=params)  # a radix hit on the stem
    assert own["fp16_route"] >= 1 and own["route"] == 0
    assert calls["route"] >= 1


def test_gpu_pool_with_head_dim_16_is_refused_at_start():
    """Compiled, the int tiers' dot needs head_dim >= 32: a CUDA pool of head_dim 16 is refused
    with the flag to use instead (the pool is built on CPU and relabelled: only its device is read)."""
    pool = TieredKVPool(64, LAYERS, HKV, 16, torch.float16, "cpu", TierStorePlan(40, 32, 32), group_size=16,
                        page_size=PAGE)
    pool.device = "cuda:0"
    with pytest.raises(ValueError, match="head_dim >= 32 on a GPU.*--attention-backend torch"):
        create_attention_backend("triton", kv_pool=pool, num_q_heads=HQ, num_kv_heads=HKV, head_dim=16)
