import itertools

import pytest
import torch

from sgl_kvxfer.spectrum.budget import budget_quarters, check_budget, tier_counts
from sgl_kvxfer.spectrum.objective import DEFAULT_DELTA, is_importance_sorted, weighted_error
from sgl_kvxfer.spectrum.policies import TIER_POLICIES, create_tier_policy
from sgl_kvxfer.spectrum.policies.balanced import balanced_fractions
from sgl_kvxfer.spectrum.tiers import TIER_DROP, TIER_FP16, TIER_INT4, TIER_INT8

BUDGETS = [round(0.25 + 0.05 * i, 2) for i in range(16)]
SIZES = [1, 2, 3, 5, 8, 17, 64, 100, 257, 1000]
RANKED = [name for name in TIER_POLICIES if create_tier_policy(name).ranked]


def scores(n, seed=0):
    return torch.rand(n, generator=torch.Generator().manual_seed(seed))


def test_registry():
    assert set(TIER_POLICIES) == {"greedy", "sink-protect", "adaptive-2tier", "balanced", "random-tier",
                                  "uniform-int8", "uniform-int4", "pdtrim", "sws", "kivi"}
    for name in TIER_POLICIES:
        assert create_tier_policy(name).name == name
    assert create_tier_policy("pdtrim", first_ratio=0.3).first_ratio == 0.3
    with pytest.raises(ValueError):
        create_tier_policy("nope")


@pytest.mark.parametrize("name", list(TIER_POLICIES))
@pytest.mark.parametrize("int4", [True, False])
@pytest.mark.parametrize("num_sink", [0, 4])
def test_every_policy_respects_budget(name, int4, num_sink):
    policy = create_tier_policy(name)
    for n, b in itertools.product(SIZES, BUDGETS):
        imp = scores(n, n)
        if name in ("uniform-int4", "kivi") and not int4:
            with pytest.raises(ValueError):
                policy.assign(imp, b, num_sink, int4)
            continue
        tiers = policy.assign(imp, b, num_sink, int4, rng_seed=n)
        assert tiers.dtype == torch.int8 and tiers.shape == (n,)
        assert int(tiers.min()) >= TIER_FP16 and int(tiers.max()) <= TIER_DROP
        check_budget(tiers, b)
        if not int4:
            assert not (tiers == TIER_INT4).any()
        if policy.ranked:
            assert is_importance_sorted(imp, tiers, policy.sink_count(num_sink)), (name, n, b)


@pytest.mark.parametrize("name", ["greedy", "sink-protect", "random-tier", "balanced"])
def test_three_tier_policies_never_drop_from_quarter_budget(name):
    for n, b in itertools.product(SIZES, BUDGETS):
        tiers = create_tier_policy(name).assign(scores(n), b, num_sink=4)
        assert not (tiers == TIER_DROP).any()


@pytest.mark.parametrize("name", RANKED)
def test_exchange_argument(name):
    """Swapping tiers of any pair with I_a >= I_b where a holds the higher precision never lowers J."""
    policy = create_tier_policy(name)
    n = 40
    imp = scores(n, 3)
    for b in (0.3, 0.45, 0.6, 0.85):
        tiers = policy.assign(imp, b)
        base = weighted_error(imp, tiers)
        s = policy.sink_count(0)                         # pinned sinks are exempt from ranking
        for a, c in itertools.combinations(range(s, n), 2):
            swapped = tiers.clone()
            swapped[a], swapped[c] = tiers[c], tiers[a]
            assert weighted_error(imp, swapped) >= base - 1e-12


def test_greedy_is_optimal_for_its_counts_brute_force():
    policy = create_tier_policy("greedy")
    for n, b, seed in itertools.product([4, 5, 6], [0.3, 0.4, 0.55, 0.7], range(3)):
        imp = scores(n, seed)
        tiers = policy.assign(imp, b)
        best = min(weighted_error(imp, torch.tensor(p)) for p in set(itertools.permutations(tiers.tolist())))
        assert weighted_error(imp, tiers) == pytest.approx(best)


def test_greedy_beats_random_tier_objective():
    imp = scores(500, 1) ** 4
    for b in (0.3, 0.4, 0.6, 0.8):
        g = create_tier_policy("greedy").assign(imp, b)
        r = create_tier_policy("random-tier").assign(imp, b, rng_seed=7)
        assert torch.equal(torch.bincount(g.long(), minlength=4), torch.bincount(r.long(), minlength=4))
        assert weighted_error(imp, g) <= weighted_error(imp, r)


def test_greedy_counts_and_paper_points():
    imp = scores(1000)
    g = create_tier_policy("greedy")
    assert (g.assign(imp, 0.5) == TIER_INT8).all()            # b=0.5 collapses to all-int8 (Sec. 6.1)
    assert (g.assign(imp, 1.0) == TIER_FP16).all()
    t = g.assign(imp, 0.3)
    assert int((t == TIER_INT4).sum()) == 800 and int((t == TIER_INT8).sum()) == 200
    # without int4 greedy falls back to the 2-tier map, identical to adaptive-2tier
    for b in BUDGETS:
        assert torch.equal(g.assign(imp, b, 4, int4_allowed=False),
                           create_tier_policy("adaptive-2tier").assign(imp, b, 4, int4_allowed=True))
    t = g.assign(imp, 0.3, int4_allowed=False)
    assert int((t == TIER_INT8).sum()) == 600 and int((t == TIER_DROP).sum()) == 400


def test_sink_pinning():
    imp = torch.arange(100, dtype=torch.float32)     # sinks are the *least* important by score
    for name in ("greedy", "sink-protect", "adaptive-2tier", "random-tier"):
        for b in (0.3, 0.5, 0.7):
            if name == "adaptive-2tier" and b == 0.5:
                continue  # exactly all-int8: a pinned fp16 sink would force a drop, so none pin
            t = create_tier_policy(name).assign(imp, b, num_sink=4, rng_seed=1)
            assert (t[:4] == TIER_FP16).all(), (name, b)
    # greedy honors num_sink=0 (no pin); sink-protect substitutes its default of 4
    assert (create_tier_policy("greedy").assign(imp, 0.7)[:4] != TIER_FP16).all()
    assert (create_tier_policy("sink-protect").assign(imp, 0.7)[:4] == TIER_FP16).all()
    assert (create_tier_policy("sink-protect", default_num_sink=8).assign(imp, 0.7)[:8] == TIER_FP16).all()
    assert (create_tier_policy("adaptive-2tier").assign(imp, 0.5, num_sink=4) == TIER_INT8).all()
    # at b = 0.25 pinning would force drops, so nothing is pinned
    assert (create_tier_policy("greedy").assign(imp, 0.25, num_sink=4) == TIER_INT4).all()
    # sink pinned fp16 costs budget: the rest follows Eq. 14/15 on (4bn - 4s) / (n - s)
    t = create_tier_policy("greedy").assign(imp, 0.7, num_sink=4)
    c = tier_counts(0.7, 100, 4)
    assert int((t == TIER_FP16).sum()) == c.fp16 and c.fp16 == 4 + (280 - 16 - 2 * 96) // 2


def test_random_tier_seeded():
    imp = scores(300)
    p = create_tier_policy("random-tier")
    a, b, c = p.assign(imp, 0.4, 4, rng_seed=11), p.assign(imp, 0.4, 4, rng_seed=11), p.assign(imp, 0.4, 4, rng_seed=12)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert not is_importance_sorted(imp, a, 4)


def test_balanced():
    f = balanced_fractions(0.5)
    assert f == pytest.approx((3 / 14, 5 / 14, 6 / 14))
    assert f[0] + f[1] / 2 + f[2] / 4 == pytest.approx(0.5)
    t = create_tier_policy("balanced").assign(scores(700), 0.5)
    counts = torch.bincount(t.long(), minlength=4).tolist()
    assert counts[TIER_INT4] >= 290 and counts[TIER_FP16] > 100       # substantial int4 mass at b=0.5
    for half in (t[:350], t[350:]):                                    # spread, not clustered
        assert abs(int((half == TIER_INT4).sum()) - counts[TIER_INT4] / 2) <= 2
    assert balanced_fractions(0.27)[0] == 0 and balanced_fractions(0.95)[2] == 0


def test_uniform_policies():
    imp = scores(100)
    u8, u4 = create_tier_policy("uniform-int8"), create_tier_policy("uniform-int4")
    assert (u8.assign(imp, 0.5) == TIER_INT8).all() and (u8.assign(imp, 0.9) == TIER_INT8).all()
    assert (u4.assign(imp, 0.25) == TIER_INT4).all()
    t = u8.assign(imp, 0.3)
    assert int((t == TIER_INT8).sum()) == 60 and int((t == TIER_DROP).sum()) == 40
    with pytest.raises(ValueError):
        u4.assign(imp, 0.5, int4_allowed=False)


@pytest.mark.parametrize("n", [10, 37, 100, 1001])
@pytest.mark.parametrize("b", [0.25, 0.3, 0.5, 0.7, 1.0])
def test_pdtrim_keep_counts(n, b):
    for ratio in (0.0, 0.3, 0.5, 0.9, 1.0):
        t = create_tier_policy("pdtrim", first_ratio=ratio).assign(scores(n), b)
        keep = budget_quarters(b, n) // 4
        n_first = round(keep * ratio)
        assert int((t == TIER_FP16).sum()) == keep and int((t == TIER_DROP).sum()) == n - keep
        assert (t[:n_first] == TIER_FP16).all()
        assert (t[n - (keep - n_first):] == TIER_FP16).all()
        assert (t[n_first:n - (keep - n_first)] == TIER_DROP).all()


def test_pdtrim_keeps_sinks_and_ignores_importance():
    p = create_tier_policy("pdtrim", first_ratio=0.0)
    t = p.assign(scores(100), 0.3, num_sink=4)
    assert (t[:4] == TIER_FP16).all() and (t[-26:] == TIER_FP16).all()
    assert torch.equal(p.assign(scores(100, 1), 0.3), p.assign(scores(100, 2), 0.3))


def test_sws_keeps_top_k():
    imp = scores(200)
    t = create_tier_policy("sws").assign(imp, 0.3)
    kept = set(torch.nonzero(t == TIER_FP16).flatten().tolist())
    assert kept == set(torch.topk(imp, 60).indices.tolist())
    assert set(t.unique().tolist()) == {TIER_FP16, TIER_DROP}
    t = create_tier_policy("sws").assign(torch.arange(200.0), 0.3, num_sink=4)
    assert (t[:4] == TIER_FP16).all() and int((t == TIER_FP16).sum()) == 60


def test_sortedness_checker_detects_violation():
    imp = torch.tensor([3.0, 2.0, 1.0])
    assert is_importance_sorted(imp, torch.tensor([0, 1, 2]))
    assert not is_importance_sorted(imp, torch.tensor([1, 0, 2]))
    assert is_importance_sorted(torch.tensor([1.0, 1.0]), torch.tensor([2, 0]))   # ties: any order
    assert is_importance_sorted(imp, torch.tensor([2, 0, 1]), num_sink=1)
    assert DEFAULT_DELTA == tuple(sorted(DEFAULT_DELTA))


@pytest.mark.parametrize("budget", [0.05, 0.3, 0.5, 0.77, 1.0])
@pytest.mark.parametrize("n,sinks,int4", [(1, 0, True), (37, 4, True), (512, 4, False), (2048, 64, True)])
def test_byte_budget_search_on_counts_equals_the_search_on_assignments(budget, n, sinks, int4, monkeypatch):
    """The greedy policy's byte-budget search tests each budget on its tier counts (no
    assignment built): the same tiers and cost budget as building every assignment."""
    from sgl_kvxfer.spectrum.budget import KVLayout
    from sgl_kvxfer.spectrum.byte_budget import fit_byte_budget
    from sgl_kvxfer.spectrum.policies import create_tier_policy

    layout = KVLayout(32, 8, 128, 32, page_size=64)
    policy = create_tier_policy("greedy", layout=layout, budget=budget)
    imp = torch.rand(n, generator=torch.Generator().manual_seed(n))
    fast, b_fast = fit_byte_budget(policy, imp, budget, layout, sinks, int4)
    monkeypatch.setattr(type(policy), "counts_for", lambda self, *a, **k: None)
    slow, b_slow = fit_byte_budget(policy, imp, budget, layout, sinks, int4)
    assert b_fast == b_slow and torch.equal(fast, slow)
