import math

import pytest
import torch

from sgl_kvxfer.spectrum.budget import (BudgetExceededError, KVLayout, assignment_bytes, budget_quarters,
                                        byte_ratio, check_budget, cost, effective_sinks, fp16_bytes,
                                        normalized_cost, respects_budget, tier_counts, tier_fractions)
from sgl_kvxfer.spectrum.tiers import TIER_DROP, TIER_FP16, TIER_INT4, TIER_INT8

BUDGETS = [round(0.25 + 0.05 * i, 2) for i in range(16)]


def test_cost_model():
    assert (cost(16), cost(8), cost(4)) == (1.0, 0.5, 0.25)
    with pytest.raises(ValueError):
        cost(2)


def test_normalized_cost_eq3():
    tiers = torch.tensor([TIER_FP16, TIER_INT8, TIER_INT4, TIER_DROP], dtype=torch.int8)
    assert normalized_cost(tiers) == pytest.approx((1 + 0.5 + 0.25 + 0) / 4)


def test_budget_quarters_absorbs_float_error():
    assert budget_quarters(0.35, 100) == 140      # 4 * 0.35 * 100 = 139.99999999999997
    assert budget_quarters(0.3, 10) == 12
    assert budget_quarters(0.3, 3) == 3           # 3.6 -> 3


def test_check_budget_exact():
    n = 10
    tiers = torch.full((n,), TIER_INT8, dtype=torch.int8)
    assert check_budget(tiers, 0.5) == 0.5
    tiers[0] = TIER_FP16
    assert not respects_budget(tiers, 0.5)
    with pytest.raises(BudgetExceededError):
        check_budget(tiers, 0.5)
    assert check_budget(tiers, 0.55) == pytest.approx(0.55)


@pytest.mark.parametrize("int4", [True, False])
def test_fraction_map_properties(int4):
    prev = None
    for i in range(0, 101):
        b = i / 100
        f = tier_fractions(b, int4)
        assert sum(f) == pytest.approx(1.0)
        assert all(x >= -1e-12 for x in f)
        assert f[0] + f[1] / 2 + f[2] / 4 == pytest.approx(b)
        if not int4:
            assert f[2] == 0
        if prev is not None:  # fp16 grows and drop shrinks with the budget, continuously
            assert f[0] >= prev[0] - 1e-12 and f[3] <= prev[3] + 1e-12
            if b > 0.25:      # above b = 1/4 int4 only gives way (below it, int4 replaces drops)
                assert f[2] <= prev[2] + 1e-12
            assert max(abs(a - c) for a, c in zip(f, prev)) <= 0.04 + 1e-9
        prev = f


def test_eq14_eq15_values():
    assert tier_fractions(0.3) == pytest.approx((0, 0.2, 0.8, 0))   # Sec. 6.2: ~80% int4 at b=0.3
    assert tier_fractions(0.25) == pytest.approx((0, 0, 1, 0))
    assert tier_fractions(0.5) == pytest.approx((0, 1, 0, 0))
    assert tier_fractions(0.75) == pytest.approx((0.5, 0.5, 0, 0))
    assert tier_fractions(1.0) == pytest.approx((1, 0, 0, 0))
    assert tier_fractions(0.3, int4_allowed=False) == pytest.approx((0, 0.6, 0, 0.4))  # Sec. 7.4.3


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4097])
@pytest.mark.parametrize("int4", [True, False])
@pytest.mark.parametrize("num_sink", [0, 4])
def test_integer_counts_match_map(n, int4, num_sink):
    for b in BUDGETS:
        c = tier_counts(b, n, num_sink, int4)
        assert c.total == n
        assert c.quarters <= budget_quarters(b, n)
        assert c.num_sink <= min(num_sink, n)
        if not int4:
            assert c.int4 == 0
        if int4 or b >= 0.5:
            assert c.drop == 0
        if num_sink == 0:
            f = tier_fractions(b, int4)
            # floors lose at most one token per tier boundary
            assert abs(c.fp16 - f[0] * n) <= 1 and abs(c.int8 - f[1] * n) <= 2 and abs(c.int4 - f[2] * n) <= 1
            # Eq. 14 band spends the budget exactly; Eq. 15 band wastes less than one int8->fp16 upgrade
            assert budget_quarters(b, n) - c.quarters < (1 if int4 and b < 0.5 else 2) or c.fp16 == n


def test_sinks_never_cause_drops():
    assert effective_sinks(0.25, 100, 4) == 0
    assert effective_sinks(0.3, 100, 4) == 4          # 120 quarters: 4*4 + 96 >= ... fits
    assert effective_sinks(0.3, 100, 10) == 6         # (120 - 100) // 3
    c = tier_counts(0.3, 100, 4)
    assert (c.fp16, c.int8, c.int4, c.drop, c.num_sink) == (4, 8, 88, 0, 4)
    # 2-tier below 0.5 drops anyway; sinks stay pinned
    c = tier_counts(0.3, 100, 4, int4_allowed=False)
    assert c.num_sink == 4 and c.quarters <= 120 and c.int8 == (120 - 16) // 2


def test_byte_accounting_exact():
    lay = KVLayout(num_layers=2, num_kv_heads=3, head_dim=64, group_size=32, elem_bytes=2)
    assert lay.vector_bytes(TIER_FP16) == 128
    assert lay.vector_bytes(TIER_INT8) == 64 + 2 * 2 * 2        # 2 groups x (scale + zero) x 2 bytes
    assert lay.vector_bytes(TIER_INT4) == 32 + 8
    assert lay.vector_bytes(TIER_INT8, with_scales=False) == 64
    assert lay.vector_bytes(TIER_DROP) == 0
    assert lay.token_bytes(TIER_FP16) == 2 * 2 * 3 * 128
    tiers = torch.tensor([0, 1, 1, 2, 2, 2, 3], dtype=torch.int8)
    per = 2 * 2 * 3
    assert assignment_bytes(tiers, lay) == per * (128 + 2 * 72 + 3 * 40)
    assert assignment_bytes(tiers, lay, with_scales=False) == per * (128 + 2 * 64 + 3 * 32)
    assert fp16_bytes(7, lay) == 2 * 2 * 3 * 64 * 7 * 2            # Eq. 1
    assert byte_ratio(tiers, lay, with_scales=False) == pytest.approx(normalized_cost(tiers))
    assert byte_ratio(tiers, lay) > normalized_cost(tiers)


def test_scales_stay_fp16_for_fp32_models():
    lay = KVLayout(1, 1, 64, 32, elem_bytes=4)
    assert lay.vector_bytes(TIER_FP16) == 256 and lay.vector_bytes(TIER_INT8) == 64 + 2 * 4


def test_byte_accounting_odd_group():
    lay = KVLayout(num_layers=1, num_kv_heads=1, head_dim=80, group_size=32)
    assert lay.vector_bytes(TIER_INT4) == 40 + math.ceil(80 / 32) * 4


def test_matches_codec_payload_bytes():
    codec = pytest.importorskip("sgl_kvxfer.kernels.tier_codec")
    for d, g in [(64, 32), (128, 32), (128, 64)]:
        lay = KVLayout(1, 1, d, g)
        for t in (TIER_FP16, TIER_INT8, TIER_INT4):
            for ws in (True, False):
                assert lay.vector_bytes(t, ws) == codec.payload_bytes(t, d, g, 2, ws)
        assert [codec.budget_cost(t) for t in (0, 1, 2)] == [1.0, 0.5, 0.25]
