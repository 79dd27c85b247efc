import math

import pytest
import torch

from sgl_kvxfer.spectrum.importance import (ImportanceAccumulator, KVNormAccumulator, norm_importance,
                                            ranking_order, recency_decay, sink_mask, token_importance)


def brute_force(qs, ks, window, scale=None, softcap=None, sliding=None):
    """Loop reference: mean over layers, query heads and windowed query rows of causal softmax rows."""
    n = ks[0].shape[0]
    start = 0 if window is None else max(0, n - window)
    total, rows = torch.zeros(n, dtype=torch.float64), 0
    for q, k in zip(qs, ks):
        hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
        s = 1 / math.sqrt(d) if scale is None else scale
        for h in range(hq):
            kh = h // (hq // hkv)
            for i in range(start, n):
                logits = []
                for j in range(n):
                    visible = j <= i and (sliding is None or j > i - sliding)
                    z = float(q[i, h].double() @ k[j, kh].double()) * s
                    if softcap is not None:
                        z = softcap * math.tanh(z / softcap)
                    logits.append(z if visible else -math.inf)
                total += torch.softmax(torch.tensor(logits, dtype=torch.float64), 0)
                rows += 1
    return (total / rows).float()


def make(n=9, layers=3, hq=4, hkv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    qs = [torch.randn(n, hq, d, generator=g) for _ in range(layers)]
    ks = [torch.randn(n, hkv, d, generator=g) for _ in range(layers)]
    return qs, ks


@pytest.mark.parametrize("window", [1, 3, 9, 20, None])
@pytest.mark.parametrize("hkv", [1, 2, 4])
def test_accumulator_matches_brute_force(window, hkv):
    qs, ks = make(hkv=hkv)
    acc = ImportanceAccumulator(9, window)
    for q, k in zip(qs, ks):
        acc.add_layer(q, k, torch.arange(9))
    a = acc.scores()
    assert torch.allclose(a, brute_force(qs, ks, window), atol=1e-5)
    assert a.sum().item() == pytest.approx(1.0, abs=1e-5)


def brute_force_head_max(qs, ks, window):
    """Loop reference of head_max: per layer, max over query heads of the window rows' mean row."""
    n = ks[0].shape[0]
    start = 0 if window is None else max(0, n - window)
    total = torch.zeros(n, dtype=torch.float64)
    for q, k in zip(qs, ks):
        hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
        per_head = torch.zeros(hq, n, dtype=torch.float64)
        for h in range(hq):
            kh = h // (hq // hkv)
            for i in range(start, n):
                z = (k[: i + 1, kh].double() @ q[i, h].double()) / math.sqrt(d)
                per_head[h, : i + 1] += torch.softmax(z, 0) / (n - start)
        total += per_head.max(0).values
    return (total / total.sum()).float()


@pytest.mark.parametrize("window", [1, 3, None])
@pytest.mark.parametrize("hkv", [1, 2])
def test_head_max_matches_brute_force(window, hkv):
    qs, ks = make(hkv=hkv)
    acc = ImportanceAccumulator(9, window, head_max=True)
    for q, k in zip(qs, ks):
        acc.add_layer(q, k, torch.arange(9))
    assert torch.allclose(acc.scores(), brute_force_head_max(qs, ks, window), atol=1e-5)


def test_head_max_finds_what_one_head_reads():
    """One head of eight puts its window mass on key 5, the others on the sink (key 0) and the
    last keys: the mean ranks key 5 below the local keys, the per-head max ranks it with the sink."""
    n, hq, d = 16, 8, 4
    q = torch.zeros(n, hq, d)
    k = torch.zeros(n, 1, d)
    k[0, 0, 0] = k[5, 0, 1] = 1.0
    k[12:, 0, 2] = 1.0
    q[:, 0, 1] = 30.0                      # the "retrieval" head: key 5
    q[:, 1:4, 0] = 30.0                    # sink heads
    q[:, 4:, 2] = 30.0                     # local heads (keys 12..15)
    mean, head_max = ImportanceAccumulator(n, 2), ImportanceAccumulator(n, 2, head_max=True)
    mean.add_layer(q, k)
    head_max.add_layer(q, k)
    assert set(ranking_order(head_max.scores())[:2].tolist()) == {0, 5}
    assert ranking_order(mean.scores()).tolist().index(5) == 4  # after the sink and keys 12..14


def test_accumulator_chunked_prefill_and_default_positions():
    qs, ks = make(n=10)
    whole = ImportanceAccumulator(10, 4)
    chunked = ImportanceAccumulator(10, 4)
    for q, k in zip(qs, ks):
        whole.add_layer(q, k)                          # default positions: last T_q of T keys
        chunked.add_layer(q[:6], k[:6], torch.arange(6))   # outside the window: ignored
        chunked.add_layer(q[6:], k, torch.arange(6, 10))
    assert torch.allclose(whole.scores(), chunked.scores(), atol=1e-6)
    assert whole.num_rows == 3 * 4 * 4


def test_accumulator_softcap_sliding_scale():
    qs, ks = make(n=8, hkv=1)
    acc = ImportanceAccumulator(8, 5)
    for q, k in zip(qs, ks):
        acc.add_layer(q, k, scale=0.3, logit_softcap=2.0, sliding_window=3)
    ref = brute_force(qs, ks, 5, scale=0.3, softcap=2.0, sliding=3)
    assert torch.allclose(acc.scores(), ref, atol=1e-5)


def test_accumulator_errors():
    acc = ImportanceAccumulator(5, 2)
    with pytest.raises(RuntimeError):
        acc.scores()
    with pytest.raises(ValueError):
        acc.add_layer(torch.randn(2, 3, 4), torch.randn(5, 2, 4))   # 3 not a multiple of 2
    with pytest.raises(ValueError):
        acc.add_layer(torch.randn(1, 2, 4), torch.randn(3, 2, 4), torch.tensor([4]))  # key 4 missing


def test_recency_decay_and_importance():
    d = recency_decay(4, 0.5)
    assert torch.allclose(d, torch.exp(-0.5 * torch.tensor([3.0, 2.0, 1.0, 0.0])))
    a = torch.tensor([0.4, 0.3, 0.2, 0.1])
    assert torch.allclose(token_importance(a, 0.0), a)
    assert torch.allclose(token_importance(a, 0.5), a * d)


def test_norm_importance():
    k = [torch.zeros(3, 2, 4) for _ in range(2)]
    k[0][1] = 1.0          # token 1 has norm 2 in layer 0
    k[1][2] = 2.0          # token 2 has norm 4 in layer 1
    a = norm_importance(k)
    assert torch.allclose(a, torch.tensor([0.0, 1 / 3, 2 / 3]))
    stacked = norm_importance(torch.stack(k), torch.stack(k))
    assert torch.allclose(stacked, a)
    acc = KVNormAccumulator(3)
    for x in k:
        acc.add_layer(x)
    assert torch.allclose(acc.scores(), a)


def test_sink_pinning_ranking():
    imp = torch.tensor([0.0, 0.1, 5.0, 1.0, 5.0, 0.5])
    assert sink_mask(6, 2).tolist() == [True, True, False, False, False, False]
    assert ranking_order(imp, 2).tolist() == [0, 1, 2, 4, 3, 5]   # sinks first, ties by position
    assert ranking_order(imp, 0).tolist() == [2, 4, 3, 5, 1, 0]
    assert ranking_order(imp, 10).tolist() == list(range(6))


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("q_start,t_q", [(0, 40), (24, 16), (40, 8), (0, 10)])
def test_add_range_equals_add_layer(fused, q_start, t_q):
    """add_range (host-known chunk positions, no device read-back) gives add_layer's sums bit
    for bit, window cut included (a chunk before the window adds nothing)."""
    torch.manual_seed(0)
    n, hq, hkv, d = 48, 8, 2, 16
    t = q_start + t_q
    q, k = torch.randn(t_q, hq, d), torch.randn(t, hkv, d)
    a = ImportanceAccumulator(n, window=12, fused_heads=fused)
    b = ImportanceAccumulator(n, window=12, fused_heads=fused)
    a.add_layer(q, k, q_positions=torch.arange(q_start, t))
    b.add_range(q, k, q_start)
    assert a.num_rows == b.num_rows
    assert torch.equal(a._mass, b._mass)
    assert b.has_data == (t > n - 12)
    if b.has_data:
        with pytest.raises(ValueError):
            b.add_range(q, k[:-1], q_start)  # a query without its key
