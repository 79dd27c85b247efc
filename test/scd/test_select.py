"""Patch-layer selection (paper Appendix A) on synthetic sensitivity profiles."""
import pytest

from sgl_kvxfer.scd.calib.select import select_patch_layers


def additive(weights):
    return lambda s: sum(weights[l] for l in s)


def test_restore_one_greedy_and_fixed_budget():
    w = [0.0, 0.5, 0.05, 3.0, 0.1, 1.0, 0.0, 2.0]
    sel = select_patch_layers(additive(w), len(w), budget=3, pool=4)
    assert sel.candidates == [3, 7, 5, 1]
    assert [l for l, _ in sel.greedy] == [3, 7, 5] and sel.layers == (3, 5, 7) and sel.k == 3
    assert sel.restore_one[3] == pytest.approx(3.0) and sel.greedy[-1][1] == pytest.approx(6.0)
    assert sel.evaluations == 1 + 8 + 3 + 2  # F({}), restore-one (= greedy step 1), steps 2 and 3


def test_greedy_sees_interactions_restore_one_cannot():
    """Layers 2 and 5 are redundant (either fixes the same drift); 6 looks weak alone but helps
    on top: greedy must skip the redundant partner."""
    def F(s):
        return (2.0 if (2 in s or 5 in s) else 0.0) + (0.8 if 6 in s else 0.0) + (0.1 if 0 in s else 0.0)
    sel = select_patch_layers(F, 8, budget=2, pool=4)
    assert sel.candidates[:2] == [2, 5]
    assert sel.layers == (2, 6)


def test_auto_budget_maximizes_gain_per_layer():
    """Two layers only pay off together (synergy), a third adds little: dF/k peaks at k = 2."""
    def F(s):
        return (5.0 if {1, 4} <= s else 0.5 * len(s & {1, 4})) + 0.2 * len(s & {0, 2})
    sel = select_patch_layers(F, 6, budget="auto", k_min=1, k_max=4, pool=6)
    assert sel.k == 2 and sel.layers == (1, 4)
    assert sel.efficiency[1] == max(sel.efficiency) == pytest.approx(2.5)
    # k_min forces a larger set even when a smaller one is more efficient
    assert select_patch_layers(F, 6, budget="auto", k_min=3, k_max=4, pool=6).k == 3


def test_budget_zero_and_bad_input():
    sel = select_patch_layers(lambda s: 1.0, 4, budget=0)
    assert sel.layers == () and sel.evaluations == 1
    with pytest.raises(ValueError, match="budget"):
        select_patch_layers(lambda s: 0.0, 4, budget=5)
