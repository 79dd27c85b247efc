"""Round-trip bounds and byte accounting of the torch reference tier codec."""
import pytest
import torch

from sgl_kvxfer.kernels import tier_codec as tc


def _groups(x, g):
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // g, g)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group_size", [16, 32, 64])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_round_trip_error_within_half_scale(bits, group_size, dtype):
    torch.manual_seed(bits * 100 + group_size)
    x = (torch.randn(5, 3, 128) * 3 + torch.randn(5, 3, 1)).to(dtype)
    q, scale, zero = tc.quantize(x, bits, group_size)
    D = x.shape[-1]
    assert q.dtype == torch.uint8 and scale.dtype == torch.float16 and zero.dtype == torch.float16
    assert q.shape == (5, 3, D if bits == 8 else D // 2)
    assert scale.shape == zero.shape == (5, 3, D // group_size)
    xr = tc.dequantize(q, scale, zero, bits, group_size, out_dtype=torch.float32)
    err = _groups((xr - x.float()).abs(), group_size).amax(-1)
    bound = scale.float() / 2 * (1 + 1e-5) + 1e-6
    assert (err <= bound).all(), (err - bound).max()
    # zero is the (rounded-down) group minimum; the range covers the group maximum
    xg = _groups(x, group_size)
    assert (zero.float() <= xg.amin(-1)).all()
    qmax = (1 << bits) - 1
    assert (zero.float() + qmax * scale.float() >= xg.amax(-1) * (1 - 1e-6) - 1e-6).all()


def test_int8_error_is_relative_to_range():
    torch.manual_seed(0)
    x = torch.randn(64, 128, dtype=torch.float16)
    q, s, z = tc.quantize(x, 8, 32)
    xr = tc.dequantize(q, s, z, 8, 32, torch.float16)
    rng = _groups(x, 32).amax(-1) - _groups(x, 32).amin(-1)
    err = _groups((xr.float() - x.float()).abs(), 32).amax(-1)
    # half a quantum of 255 + the fp16 output cast
    assert (err <= rng / 255 / 2 * 1.01 + 2e-3 * _groups(x, 32).abs().amax(-1)).all()


def test_int4_nibble_order():
    # group of 4 channels: min 0, max 15 -> scale 1, zero 0, q == x
    x = torch.tensor([[1.0, 2.0, 0.0, 15.0, 3.0, 4.0, 5.0, 6.0]])
    q, s, z = tc.quantize(x, 4, 8)
    assert s.item() == 1.0 and z.item() == 0.0
    # split halves: byte j = channel j (low nibble) | channel j + 4 (high nibble)
    assert q.tolist() == [[1 | (3 << 4), 2 | (4 << 4), 0 | (5 << 4), 15 | (6 << 4)]]
    assert tc.unpack_int4(q).tolist() == [[1, 2, 0, 15, 3, 4, 5, 6]]


def test_half_up_rounding_and_constant_group():
    x = torch.tensor([[0.0, 0.5, 1.5, 255.0]])  # scale 1 -> q = floor(v + .5)
    q, s, z = tc.quantize(x, 8, 4)
    assert q.tolist() == [[0, 1, 2, 255]]
    c = torch.full((2, 32), -3.25, dtype=torch.float16)
    q, s, z = tc.quantize(c, 4, 32)
    assert (s == 0).all() and (z == -3.25).all() and (q == 0).all()
    assert (tc.dequantize(q, s, z, 4, 32) == c).all()


def test_fp16_input_zero_is_exact_min():
    torch.manual_seed(1)
    x = torch.randn(10, 64, dtype=torch.float16)
    _, _, z = tc.quantize(x, 8, 32)
    assert torch.equal(z, _groups(x, 32).amin(-1).half())


@pytest.mark.parametrize("head_dim,group_size", [(64, 32), (128, 32), (128, 64), (128, 128)])
def test_payload_bytes_exact(head_dim, group_size):
    ng = head_dim // group_size
    assert tc.payload_bytes(tc.TIER_FP16, head_dim, group_size) == 2 * head_dim
    assert tc.payload_bytes(tc.TIER_FP16, head_dim, group_size, elem_bytes=4) == 4 * head_dim
    assert tc.payload_bytes(tc.TIER_INT8, head_dim, group_size) == head_dim + 4 * ng
    assert tc.payload_bytes(tc.TIER_INT4, head_dim, group_size) == head_dim // 2 + 4 * ng
    assert tc.payload_bytes(tc.TIER_INT8, head_dim, group_size, with_scales=False) == head_dim
    assert tc.payload_bytes(tc.TIER_INT4, head_dim, group_size, with_scales=False) == head_dim // 2
    # the formula matches the tensors quantize actually produces
    x = torch.randn(1, head_dim, dtype=torch.float16)
    for tier in (tc.TIER_INT8, tc.TIER_INT4):
        q, s, z = tc.quantize(x, tc.TIER_BITS[tier], group_size)
        nbytes = q.numel() * q.element_size() + s.numel() * 2 + z.numel() * 2
        assert nbytes == tc.payload_bytes(tier, head_dim, group_size)


def test_budget_cost_and_constants():
    assert (tc.TIER_FP16, tc.TIER_INT8, tc.TIER_INT4) == (0, 1, 2)
    assert tc.TIER_BITS == {0: 16, 1: 8, 2: 4}
    assert [tc.budget_cost(t) for t in tc.TIERS] == [1.0, 0.5, 0.25]
    assert tc.DEFAULT_GROUP_SIZE == 32


@pytest.mark.parametrize("b", [1.0, 0.75, 0.5, 0.3, 0.25])
def test_greedy_fractions_meet_budget(b):
    f = tc.greedy_tier_fractions(b)
    assert abs(sum(f) - 1) < 1e-9
    assert abs(sum(fi * tc.budget_cost(t) for fi, t in zip(f, tc.TIERS)) - b) < 1e-9


def test_bad_arguments():
    with pytest.raises(ValueError):
        tc.quantize(torch.zeros(1, 48), 8, 32)
    with pytest.raises(ValueError):
        tc.quantize(torch.zeros(1, 32), 2, 32)
