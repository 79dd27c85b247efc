"""Native CPU kernels (kernels/cpu_ops.py) against their torch references, and the prepacked
oneDNN linears (layers/cpu_linear.py) against F.linear.

Tolerances: RoPE and the residual sum are bitwise equal to torch (the kernels round every
intermediate torch rounds); SiLU may be one bf16 ulp off on rare elements (exp), RMSNorm two
(an fp32 reduction-order difference in 1/rms moves the rounded x/rms by one ulp, which the
weight multiply and its second rounding can turn into two). Decode attention keeps softmax and accumulation in fp32 (torch's bf16
SDPA rounds the probabilities to bf16), so it is checked against an fp32 reference within a
bf16 rounding of the output, and against the bf16 SDPA path more loosely.
"""
import pytest
import torch
import torch.nn.functional as F

from sgl_kvxfer.kernels import cpu_ops

# NOTE: collection must build nothing (a build takes minutes): the mark only looks for the
# toolchain; the fixture below builds (or loads) the extension when the first test runs.
pytestmark = [pytest.mark.skipif(not cpu_ops.toolchain_found(), reason="no C++ toolchain for the native CPU kernels"),
              pytest.mark.usefixtures("native_cpu_ops")]

BF16 = torch.bfloat16


def _ordered(x: torch.Tensor) -> torch.Tensor:
    b = x.contiguous().view(torch.int16).to(torch.int32)
    return torch.where(b >= 0, b, -(b & 0x7FFF))


def assert_ulp(got, ref, max_ulp=1, max_frac=0.01):
    assert got.shape == ref.shape and got.dtype == ref.dtype
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        return
    d = (_ordered(got) - _ordered(ref)).abs()
    assert int(d.max()) <= max_ulp, f"max {int(d.max())} ulp"
    assert int((d > 0).sum()) <= max(1, max_frac * d.numel())


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("T,H", [(1, 64), (37, 576), (300, 4096)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rmsnorm(T, H, dtype, with_residual):
    g = torch.Generator().manual_seed(T + H)
    x = (torch.randn(T, 2 * H, generator=g) * 3).to(dtype)[:, :H]  # strided rows
    r = (torch.randn(T, H, generator=g) * 3).to(dtype) if with_residual else None
    w = (1 + 0.3 * torch.randn(H, generator=g)).to(dtype)
    got = cpu_ops.add_rmsnorm(x, w, 1e-5, r)
    ref = cpu_ops.add_rmsnorm_reference(x, w, 1e-5, r)
    if with_residual:
        assert torch.equal(got[1], ref[1])
        got, ref = got[0], ref[0]
    assert_ulp(got, ref, max_ulp=2)


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("T,I", [(1, 8), (9, 1536), (64, 14336)])
def test_silu_mul(T, I, dtype):
    x = (torch.randn(T, 2 * I, generator=torch.Generator().manual_seed(I)) * 4).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # clamped exp range, zeros
    assert_ulp(cpu_ops.silu_mul(x), cpu_ops.silu_mul_reference(x))


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("T,Hq,Hkv,D", [(1, 9, 3, 64), (33, 32, 8, 128), (5, 4, 4, 24)])
def test_rope_qk_bitwise(T, Hq, Hkv, D, dtype):
    from sgl_kvxfer.layers.rope import RotaryEmbedding

    g = torch.Generator().manual_seed(T * Hq)
    qkv = (torch.randn(T, (Hq + 2 * Hkv) * D, generator=g) * 2).to(dtype)
    q = qkv[:, : Hq * D].view(T, Hq, D)  # strided views, as the model passes them
    k = qkv[:, Hq * D : (Hq + Hkv) * D].view(T, Hkv, D)
    pos = torch.randint(0, 5000, (T,), generator=g)
    cos, sin = RotaryEmbedding(D, 10000.0, None, 8192).cos_sin(pos, dtype, 5000)
    got, ref = cpu_ops.rope_qk(q, k, cos, sin), cpu_ops.rope_qk_reference(q, k, cos, sin)
    assert got[0].is_contiguous() and got[1].is_contiguous()
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def _decode_case(B, Hq, Hkv, D, dtype, table_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = 4000
    k_buf = torch.randn(S, Hkv, D, generator=g).to(dtype)
    v_buf = torch.randn(S, Hkv, D, generator=g).to(dtype)
    R, C = B + 3, 700
    table = torch.zeros(R, C, dtype=table_dtype)
    lens = torch.randint(1, C, (B,), generator=g)
    lens[0] = 1  # a request that sees only its own new token
    rows = torch.randperm(R, generator=g)[:B]
    for b in range(B):  # each request: a contiguous run (a prefill) then scattered slots (decode)
        n = int(lens[b])
        run = torch.arange(1, 1 + n // 2) + 5 * b
        rest = torch.randint(1, S, (n - run.numel(),), generator=g)
        table[rows[b], :n] = torch.cat([run, rest]).to(table_dtype)
    q = torch.randn(B, Hq, D, generator=g).to(dtype)
    return q, k_buf, v_buf, table, rows, lens


@pytest.mark.parametrize("B,Hq,Hkv,D", [(1, 9, 3, 64), (6, 9, 3, 64), (4, 32, 8, 128), (3, 4, 4, 8)])
@pytest.mark.parametrize("table_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_decode_attention(B, Hq, Hkv, D, table_dtype, dtype):
    q, k_buf, v_buf, table, rows, lens = _decode_case(B, Hq, Hkv, D, dtype, table_dtype)
    scale = D ** -0.5
    got = cpu_ops.decode_attention(q, k_buf, v_buf, table, rows, lens, scale)
    assert got.shape == q.shape and got.dtype == dtype
    exact = cpu_ops.decode_attention_reference(q.float(), k_buf.float(), v_buf.float(), table, rows, lens, scale)
    # fp32 math throughout: within one rounding to the dtype of the exact result
    tol = 1e-5 if dtype == torch.float32 else 2 ** -8
    torch.testing.assert_close(got.float(), exact, atol=tol, rtol=tol)
    # request 0 attends only to its one key: the output is that value row exactly
    slot = int(table[rows[0], 0])
    assert torch.equal(got[0].view(Hkv, Hq // Hkv, D), v_buf[slot][:, None, :].expand(Hkv, Hq // Hkv, D))
    if dtype == BF16:  # the bf16 SDPA path it replaces (bf16 probabilities): looser
        sdpa = cpu_ops.decode_attention_reference(q, k_buf, v_buf, table, rows, lens, scale)
        torch.testing.assert_close(got.float(), sdpa.float(), atol=2e-2, rtol=2e-2)


def test_decode_attention_rejects_bad_shapes():
    q, k_buf, v_buf, table, rows, lens = _decode_case(2, 9, 3, 64, BF16, torch.int64)
    with pytest.raises(RuntimeError, match="share one dtype"):
        cpu_ops.decode_attention(q.float(), k_buf, v_buf, table, rows, lens, 0.1)
    with pytest.raises(RuntimeError, match="out of the table's range"):
        cpu_ops.decode_attention(q, k_buf, v_buf, table, rows, lens + 10_000, 0.1)
    with pytest.raises(RuntimeError, match="head shapes"):
        cpu_ops.decode_attention(q[:, :8], k_buf, v_buf, table, rows, lens, 0.1)


@pytest.mark.parametrize("isa", ["auto", "avx2"])
@pytest.mark.parametrize("M", [1, 7, 64, 300])
def test_packed_linear_matches_f_linear(M, isa, monkeypatch):
    """Where oneDNN packs bf16 weights with native bf16 dot products (AVX512-BF16, AMX,
    AVX-NE-CONVERT) the prepared linear is F.linear bit for bit, on AVX-512 without them within
    one bf16 rounding; elsewhere (AVX2, or the cap forcing it) it is one fp32 GEMM rounded to bf16
    once: bitwise that, and like F.linear within one bf16 rounding of the exact product."""
    from sgl_kvxfer.layers.cpu_linear import pack_weight, packed_linear
    from sgl_kvxfer.utils import cpu_isa

    monkeypatch.setenv("SGL_KVXFER_CPU_ISA", isa)
    g = torch.Generator().manual_seed(M)
    w = torch.randn(1536, 576, generator=g).to(BF16)
    b = torch.randn(1536, generator=g).to(BF16)
    x = torch.randn(M, 576, generator=g).to(BF16)
    packed = pack_weight(w)
    if cpu_isa.onednn_bf16_linear():
        assert isa == "auto"
        if cpu_isa.at_least("avx512_bf16") or "avx_ne_convert" in cpu_isa.cpu_flags():
            assert torch.equal(packed_linear(x, packed), F.linear(x, w))
            assert torch.equal(packed_linear(x, packed, b), F.linear(x, w, b))
        else:  # AVX-512 without bf16 dot products: F.linear at some M takes another kernel
            for got, want in ((packed_linear(x, packed), F.linear(x, w)),
                              (packed_linear(x, packed, b), F.linear(x, w, b))):
                torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=2 ** -7)
        return
    assert packed.dtype == torch.float32
    assert torch.equal(packed_linear(x, packed, b), F.linear(x.float(), w.float(), b.float()).to(BF16))
    exact = F.linear(x.double(), w.double())
    for got in (packed_linear(x, packed), F.linear(x, w)):  # half an ulp + fp32 summation noise
        assert bool(((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-2).all())


def test_prepack_swaps_bf16_linears_only():
    from torch import nn

    from sgl_kvxfer.layers.cpu_linear import PackedLinearCPU, prepack_linears_cpu

    model = nn.Sequential(nn.Linear(16, 32), nn.Sequential(nn.Linear(32, 8)))
    assert prepack_linears_cpu(model) == 0  # fp32: untouched
    model = model.to(BF16)
    x = torch.randn(3, 16).to(BF16)
    ref = model(x)
    names = {n for n, _ in model.named_parameters()}
    assert prepack_linears_cpu(model) == 2
    assert isinstance(model[0], PackedLinearCPU) and isinstance(model[1][0], PackedLinearCPU)
    assert {n for n, _ in model.named_parameters()} == names  # same parameters, same names
    torch.testing.assert_close(model(x), ref, rtol=2**-6, atol=2**-6)  # a bf16 rounding per linear


def test_bf16_to_f32_exact():
    x = torch.randn(37, 49152 + 3).to(BF16)
    x[0, :3] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    got = cpu_ops.bf16_to_f32(x)
    assert got.dtype == torch.float32 and torch.equal(got[:, 3:], x[:, 3:].float())
    assert got[0, 0] == float("inf") and got[0, 1] == float("-inf") and bool(got[0, 2].isnan())


def test_bf16_to_f32_into_a_buffer_and_argmax_rows():
    x = torch.randn(5, 1000).to(BF16)
    buf = torch.empty(5, 1000)
    assert cpu_ops.bf16_to_f32(x, buf).data_ptr() == buf.data_ptr() and torch.equal(buf, x.float())
    f = torch.randn(64, 49152)
    f[1, [10, 20]] = 100.0  # tie: first index
    f[2, 5] = float("nan")  # NaN is the maximum, as in torch
    f[3] = float("-inf")
    assert torch.equal(cpu_ops.argmax_rows(f), cpu_ops.argmax_rows_reference(f))
    assert cpu_ops.argmax_rows(f)[1] == 10 and cpu_ops.argmax_rows(f)[2] == 5


def test_greedy_sample_takes_the_first_of_tied_maxima():
    from sgl_kvxfer.sampling.params import SamplingParams
    from sgl_kvxfer.sampling.sampler import sample

    logits = torch.zeros(3, 1000)
    logits[0, [7, 900]] = 5.0  # tie: the first index wins, as argmax
    logits[1, 999] = 1.0
    logits[2, :] = -1.0
    greedy = SamplingParams.from_dict({"temperature": 0})
    assert sample(logits, [greedy] * 3, [None] * 3) == [7, 999, 0]
