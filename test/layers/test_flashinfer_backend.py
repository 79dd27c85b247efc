"""--attention-backend flashinfer (FlashInfer's paged kernels over PagedFp16KVPool) against the
Triton backend, and its errors where it cannot run.

CPU: the flag's clear errors (no CUDA, flashinfer missing, a non-paged pool) and the paged CSR
FlashInfer is planned with. GPU (marked `gpu`, skipped without flashinfer; bf16, FlashInfer's
JIT builds one module per dtype and head_dim): one real-shape layer (Llama-3-8B, 32 q / 8 kv
heads, D 128) decode and extend through both backends on the same pool, and a SmolLM2-shaped
dummy model through the Engine (chunked prefill, a radix hit, batched decode; CUDA graphs on
and off).
"""
import random
import sys

import pytest
import torch

from sgl_kvxfer.layers.attention.flashinfer_backend import flashinfer_import_error, paged_csr

from greedy_checks import assert_greedy_close

HAS_CUDA = torch.cuda.is_available()
FI_ERROR = flashinfer_import_error()
needs_flashinfer = pytest.mark.skipif(FI_ERROR is not None, reason=f"flashinfer not importable: {FI_ERROR}")


class _FakePool:
    def __init__(self, device="cuda", layout="paged", dtype=torch.float16):
        self.device, self.layout, self.dtype, self.page_size = device, layout, dtype, 64


def test_flag_errors_clearly_without_cuda_or_flashinfer(monkeypatch):
    from sgl_kvxfer.config import EngineConfig
    from sgl_kvxfer.layers.attention import create_attention_backend

    with pytest.raises(ValueError, match="flashinfer runs on CUDA only"):
        EngineConfig(attention_backend="flashinfer", device="cpu")
    assert EngineConfig(attention_backend="flashinfer", device="cuda").resolved_page_size == 64
    with pytest.raises(ValueError, match="SpectrumKV tiering"):
        EngineConfig(attention_backend="flashinfer", device="cuda", kv_tier_budget=0.5)
    kw = dict(num_q_heads=4, num_kv_heads=2, head_dim=64)
    with pytest.raises(ValueError, match="flashinfer runs on CUDA only"):
        create_attention_backend("flashinfer", kv_pool=_FakePool(device="cpu"), **kw)
    with pytest.raises(ValueError, match="needs the paged fp16 KV pool"):
        create_attention_backend("flashinfer", kv_pool=_FakePool(layout="tiered"), **kw)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        create_attention_backend("flashinfer", kv_pool=_FakePool(dtype=torch.float32), **kw)
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # `import flashinfer` raises ImportError
    with pytest.raises(ValueError, match="flashinfer is not importable"):
        create_attention_backend("flashinfer", kv_pool=_FakePool(), **kw)


def test_paged_csr_from_req_to_token_rows():
    """Pages at each page start of the rows, one token of page 0 for a length-0 row."""
    P, width = 4, 16
    table = torch.zeros((3, width), dtype=torch.int64)
    pages = {0: [5, 2, 7], 2: [3]}
    for r, pg in pages.items():
        for pos in range(len(pg) * P):
            table[r, pos] = pg[pos // P] * P + pos % P
    rows = torch.tensor([2, 0, 1])
    lens_cpu = [3, 9, 0]  # row 1 is a padding row (its table row is all page 0)
    indptr_cpu, indptr, indices, last = paged_csr(table, rows, torch.tensor(lens_cpu), lens_cpu, P)
    assert indptr_cpu.tolist() == indptr.tolist() == [0, 1, 4, 5]
    assert indices.tolist() == [3, 5, 2, 7, 0]
    assert last.tolist() == [3, 1, 1]


# ---- GPU ---------------------------------------------------------------------------------------

def _layer_batch(mode, prefix, new, P, table, pool_pages, dev):
    """A ForwardBatch over rows 0..B-1 of `table`, each request on its own random pages."""
    from sgl_kvxfer.forward_batch import ForwardBatch

    B = len(prefix)
    lens = [p + n for p, n in zip(prefix, new)]
    perm = torch.randperm(pool_pages, device=dev) + 1  # pages 1..pool_pages
    used, out_loc, positions, rows = 0, [], [], []
    for r, (p, L) in enumerate(zip(prefix, lens)):
        n_pages = -(-L // P)
        pg = perm[used:used + n_pages]
        used += n_pages
        pos = torch.arange(L, device=dev)
        table[r, :L] = pg[pos // P] * P + pos % P
        out_loc.append(table[r, p:L])
        positions.append(pos[p:L])
    T = sum(new)
    return ForwardBatch(
        mode=mode, input_ids=torch.zeros(T, dtype=torch.int64, device=dev), positions=torch.cat(positions),
        out_cache_loc=torch.cat(out_loc), req_pool_indices=torch.arange(B, device=dev),
        seq_lens=torch.tensor(lens, device=dev), extend_prefix_lens=list(prefix), extend_seq_lens=list(new),
        seq_lens_cpu=lens, logits_positions=torch.arange(T, device=dev), req_to_token=table)


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_gpu_real_shape_layer_matches_triton(mode):
    """Llama-3-8B layer shape, bf16, page 64: both backends store the same new K/V into one pool
    and attend; outputs agree to bf16 rounding. Lengths cross page boundaries, one request has
    no prefix and one a single token."""
    from sgl_kvxfer.forward_batch import ForwardMode
    from sgl_kvxfer.layers.attention import create_attention_backend
    from sgl_kvxfer.mem_cache.paged_fp16_pool import PagedFp16KVPool

    torch.manual_seed(0)
    dev, P, Hq, Hkv, D, dt = "cuda", 64, 32, 8, 128, torch.bfloat16
    pool = PagedFp16KVPool(512 * P, 1, Hkv, D, dt, dev, page_size=P)
    for buf in pool.k_buffer + pool.v_buffer:
        buf[1:].normal_()
    if mode == "decode":
        prefix, new, fm = [0, 63, 64, 68, 3000], [1] * 5, ForwardMode.DECODE
    else:
        prefix, new, fm = [0, 64, 100, 1000, 5], [17, 5, 64, 1, 200], ForwardMode.EXTEND
    table = torch.zeros((len(prefix), 4096), dtype=torch.int64, device=dev)
    T = sum(new)
    q = torch.randn(T, Hq, D, dtype=dt, device=dev)
    k, v = torch.randn(T, Hkv, D, dtype=dt, device=dev), torch.randn(T, Hkv, D, dtype=dt, device=dev)
    batch = _layer_batch(fm, prefix, new, P, table, 510, dev)
    out = {}
    for name in ("triton", "flashinfer"):
        be = create_attention_backend(name, kv_pool=pool, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D)
        be.prepare_metadata(batch)
        out[name] = be.forward(q, k, v, 0, batch).float()
    err = (out["flashinfer"] - out["triton"]).abs().max().item()
    assert err < 2e-2, err


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("graphs", [True, False], ids=["cuda_graph", "eager"])
def test_gpu_smollm2_shape_engine_matches_triton(tmp_path, graphs):
    """SmolLM2-shaped dummy model (9 q / 3 kv heads, D 64, 30 layers), bf16, page 64: chunked
    prefill, a prompt sharing two pages with an earlier one (radix hit) and batched decode across
    page boundaries give the Triton backend's logprobs (and tokens, up to near ties)."""
    from sgl_kvxfer import Engine
    from sgl_kvxfer.models.presets import PRESETS, write_dummy_tokenizer, write_preset_config

    model_dir = write_preset_config("smollm2-135m", str(tmp_path / "smol"))
    write_dummy_tokenizer(model_dir, PRESETS["smollm2-135m"]["vocab_size"])
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (100, 300, 70, 200)]
    again = prompts[1][:140] + [7, 8, 9]
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    kw = dict(return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
    out = {}
    for backend in ("triton", "flashinfer"):
        with Engine(model_dir, load_format="dummy", dtype="bfloat16", attention_backend=backend,
                    max_total_tokens=8192, chunked_prefill_size=128, disable_cuda_graph=not graphs,
                    cuda_graph_max_bs=8) as eng:
            assert eng.runner.page_size == 64
            assert (eng.runner.graph_runner is not None) == graphs
            first = eng.generate(input_ids=prompts, sampling_params=params, **kw)
            second = eng.generate(input_ids=again, sampling_params=params, **{**kw, "logprob_start_len": 130})
            assert second["meta_info"]["cached_tokens"] == 128
            out[backend] = first + [second]
    atol = 0.1  # bf16 logprobs, different summation orders
    for f, t in zip(out["flashinfer"], out["triton"]):
        fl = torch.tensor([e[0] for e in f["meta_info"]["input_token_logprobs"] if e[0] is not None])
        tl_ = torch.tensor([e[0] for e in t["meta_info"]["input_token_logprobs"] if e[0] is not None])
        assert torch.allclose(fl, tl_, atol=atol), (fl - tl_).abs().max()
    assert_greedy_close(out["flashinfer"], out["triton"], atol)
