"""FusedKV / Lite decode and extend attention vs the gather-fuse-attend torch reference, over
random paged pools (shuffled page ids, GQA, split-K, empty and partial-page requests)."""
import pytest
import torch

from sgl_kvxfer.kernels.fusedkv_attention import (
    fusedkv_attention_reference, fusedkv_decode_attention, fusedkv_extend_attention, pack_fusion_weights,
    plan_fusedkv_splits)
from sgl_kvxfer.models.fusedkv_math import expand_key_weight

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ATOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2}
# plus one rounding of the output dtype (eps relative): at |o| >= 4 a bf16 step is 0.03125, more than
# ATOL, and the kernel's fp32 sums may round the other way from the reference's (on an H200, 4 of
# 12.5M bf16 outputs of the Llama-3-8B-shape extend were one step off)
RTOL = {torch.float16: torch.finfo(torch.float16).eps, torch.bfloat16: torch.finfo(torch.bfloat16).eps}


def _setup(kv_lens, Hq, Hkv, D, PAGE, dtype, device, sources, seed=0):
    g = torch.Generator().manual_seed(seed)
    n_req_pages = [-(-n // PAGE) for n in kv_lens]
    n_pages = sum(n_req_pages) + 3
    shape = (n_pages + 2, Hkv, PAGE, D)
    bufs = [torch.randn(shape, generator=g).to(dtype).to(device) for _ in range(2 * sources)]
    perm = (torch.randperm(n_pages, generator=g) + 1).tolist()  # page 0 is padding
    width = max(max(n_req_pages), 1) + 1  # a spare column: stale ids past lens are never read
    table = torch.zeros(len(kv_lens), width, dtype=torch.int32)
    for b, npg in enumerate(n_req_pages):
        table[b, :npg] = torch.tensor(perm[:npg], dtype=torch.int32)
        perm = perm[npg:]
        table[b, npg:] = 1
    w = None
    if sources == 2:
        kp, vw = torch.randn(2, Hkv, D // 2, generator=g), torch.randn(2, Hkv, D, generator=g)
        w = pack_fusion_weights(expand_key_weight(kp), vw).to(device)
    lens = torch.tensor(kv_lens, dtype=torch.int32, device=device)
    return tuple(bufs[:sources]), tuple(bufs[sources:]), table.to(device), lens, w


def _decode(kv_lens, Hq, Hkv, D, PAGE, sources, dtype=torch.float16, device=DEVICE, pps=None, even=False):
    kp, vp, table, lens, w = _setup(kv_lens, Hq, Hkv, D, PAGE, dtype, device, sources)
    q = torch.randn(len(kv_lens), Hq, D, generator=torch.Generator().manual_seed(9)).to(dtype).to(device)
    plan = plan_fusedkv_splits(table.shape[1], len(kv_lens), Hkv, q.device, pages_per_split=pps) if pps else None
    o = fusedkv_decode_attention(q, kp, vp, table, lens, w, split_plan=plan, even_splits=even)
    ind = torch.arange(len(kv_lens) + 1, dtype=torch.int32, device=device)
    r = fusedkv_attention_reference(q, ind, kp, vp, table, lens, w)
    assert o.shape == q.shape and o.dtype == q.dtype
    torch.testing.assert_close(o.float(), r.float(), atol=ATOL[dtype], rtol=RTOL[dtype])
    return o, (q, kp, vp, table, lens, w)


def _extend(q_lens, kv_lens, Hq, Hkv, D, PAGE, sources, dtype=torch.float16, device=DEVICE):
    kp, vp, table, lens, w = _setup(kv_lens, Hq, Hkv, D, PAGE, dtype, device, sources, seed=1)
    ind = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    q = torch.randn(sum(q_lens), Hq, D, generator=torch.Generator().manual_seed(8)).to(dtype).to(device)
    o = fusedkv_extend_attention(q, ind, kp, vp, table, lens, w, max_q_len=max(q_lens))
    r = fusedkv_attention_reference(q, ind, kp, vp, table, lens, w)
    torch.testing.assert_close(o.float(), r.float(), atol=ATOL[dtype], rtol=RTOL[dtype])
    return o, (q, ind, kp, vp, table, lens, w)


@pytest.mark.parametrize("sources", [2, 1])
@pytest.mark.parametrize("pps,even", [(1, False), (None, False), (2, True)])
def test_decode_small(sources, pps, even):
    _decode([37, 5, 0, 16], Hq=4, Hkv=2, D=32, PAGE=16, sources=sources, pps=pps, even=even)


@pytest.mark.parametrize("sources", [2, 1])
def test_decode_gqa_group3_d16(sources):
    _decode([20, 33], Hq=3, Hkv=1, D=16, PAGE=16, sources=sources, pps=1)


@pytest.mark.parametrize("sources", [2, 1])
def test_extend_small(sources):
    # request 0: 32 cached + 5 new; 1: a lone token; 2: no queries; 3: a fresh 20-token prompt
    _extend([5, 1, 0, 20], [37, 1, 3, 20], Hq=4, Hkv=2, D=32, PAGE=16, sources=sources)


def test_extend_prefill_skip_last_token_equals_decode():
    """One query per request at its last position: extend and decode attend the same keys."""
    o, (q, ind, kp, vp, table, lens, w) = _extend([1, 1], [40, 17], Hq=2, Hkv=2, D=16, PAGE=16, sources=2)
    d = fusedkv_decode_attention(q, kp, vp, table, lens, w)
    torch.testing.assert_close(d.float(), o.float(), atol=2e-3, rtol=0)


def test_identity_weights_equal_lite():
    """FusedKV with (a0, a1, b0, b1) = (0, 1, 1, 0) is Lite over (K_s1, V_s0)."""
    _, (q, kp, vp, table, lens, _) = _decode([30, 9], Hq=2, Hkv=1, D=16, PAGE=16, sources=2, pps=1)
    w = torch.zeros(4, 1, 16, device=q.device)
    w[1], w[2] = 1.0, 1.0
    fused = fusedkv_decode_attention(q, kp, vp, table, lens, w)
    lite = fusedkv_decode_attention(q, kp[1:], vp[:1], table, lens)
    assert torch.equal(fused, lite)


def test_bf16_interpreter_path():
    _decode([21], Hq=2, Hkv=1, D=16, PAGE=16, sources=2, dtype=torch.bfloat16, pps=1)
    _extend([4], [21], Hq=2, Hkv=1, D=16, PAGE=16, sources=2, dtype=torch.bfloat16)


def test_launcher_errors():
    kp, vp, table, lens, w = _setup([5], 2, 1, 16, 16, torch.float16, DEVICE, 2)
    q = torch.zeros(1, 2, 16, dtype=torch.float16, device=DEVICE)
    with pytest.raises(AssertionError, match="needs weights"):
        fusedkv_decode_attention(q, kp, vp, table, lens)
    with pytest.raises(AssertionError, match="no weights"):
        fusedkv_decode_attention(q, kp[:1], vp[:1], table, lens, w)
    with pytest.raises(AssertionError, match="float32"):
        fusedkv_decode_attention(q, kp, vp, table, lens, w.half())


@pytest.mark.gpu
@pytest.mark.parametrize("Hq,Hkv,D", [(32, 8, 128), (9, 3, 64)])
@pytest.mark.parametrize("sources", [2, 1])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_real_shapes_gpu(Hq, Hkv, D, sources, dtype):
    lens = [3000, 4096, 50, 1, 4100, 0, 777, 64]
    _decode(lens, Hq, Hkv, D, 64, sources, dtype=dtype, device="cuda")
    _decode(lens, Hq, Hkv, D, 64, sources, dtype=dtype, device="cuda", pps=3, even=True)


@pytest.mark.gpu
@pytest.mark.parametrize("Hq,Hkv,D", [(32, 8, 128), (9, 3, 64)])
@pytest.mark.parametrize("sources", [2, 1])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_extend_real_shapes_gpu(Hq, Hkv, D, sources, dtype):
    _extend([700, 1, 1, 300, 2048], [1500, 4096, 1, 300, 2048], Hq, Hkv, D, 64, sources, dtype=dtype, device="cuda")
