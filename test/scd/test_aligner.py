"""Patch aligners: several consumers trained side by side equal each trained alone, and the
parameters they return are codec.apply_aligner's."""
import pytest
import torch

from sgl_kvxfer.scd.calib.aligner import train_aligners
from sgl_kvxfer.scd.codec import ALIGNER_PARAMS, apply_aligner


def _data(consumers=2, n=3000, r_h=6, hidden=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, r_h, generator=g)
    targets, lin_ws, lin_bs, w_kvs = [], [], [], []
    for _ in range(consumers):
        w = torch.randn(r_h, hidden, generator=g)
        targets.append(torch.relu(z @ w) + 0.01 * torch.randn(n, hidden, generator=g))
        lin_w = torch.linalg.lstsq(z, targets[-1]).solution  # the linear start, as the joint fit gives it
        lin_ws.append(lin_w)
        lin_bs.append(targets[-1].mean(0) - z.mean(0) @ lin_w)
        w_kvs.append(torch.randn(4, hidden, generator=g))
    return z, targets, lin_ws, lin_bs, w_kvs


def test_side_by_side_equals_alone():
    z, targets, lin_ws, lin_bs, w_kvs = _data()
    kw = dict(width=16, steps=200, lr=1e-2, batch=256, aux=1.0, seed=3, eval_every=20, patience=3)
    together = train_aligners(z, targets, lin_ws, lin_bs, w_kvs=w_kvs, **kw)
    for i in range(2):
        (alone_p, alone_r), = train_aligners(z, [targets[i]], [lin_ws[i]], [lin_bs[i]], w_kvs=[w_kvs[i]], **kw)
        p, r = together[i]
        assert set(p) == set(ALIGNER_PARAMS)
        assert r["best_step"] == alone_r["best_step"] and r["stopped"] == alone_r["stopped"]
        assert r["steps_run"] == alone_r["steps_run"]
        for k in ALIGNER_PARAMS:
            assert torch.allclose(p[k], alone_p[k], atol=1e-5, rtol=1e-4), k
        # the trained aligner, run by the serving codec, beats its linear start on held-out rows
        assert r["val_loss_best"] < r["val_loss_linear"]
        err = (apply_aligner(p, z) - targets[i]).pow(2).mean()
        lin = (z @ lin_ws[i] + lin_bs[i] - targets[i]).pow(2).mean()
        assert err < lin


def test_time_budget_stops_every_consumer():
    z, targets, lin_ws, lin_bs, _ = _data(consumers=3)
    out = train_aligners(z, targets, lin_ws, lin_bs, width=8, steps=100000, eval_every=5, patience=0,
                         time_budget_s=0.2)
    assert [r["stopped"] for _, r in out] == ["time"] * 3
    assert all(0 < r["steps_run"] < 100000 for _, r in out)
    # the cosine follows the clock too: a run the time budget ends has annealed its rate (to 0.05
    # of the start at the end), though it ran a sliver of its step cap
    assert all(r["lr_last"] < 0.1 for _, r in out)


def test_step_cap_anneals_without_a_time_budget():
    z, targets, lin_ws, lin_bs, _ = _data(consumers=1, n=500)
    (_, r), = train_aligners(z, targets, lin_ws, lin_bs, width=8, steps=40, eval_every=10, patience=0)
    assert r["stopped"] == "max_steps" and r["lr_last"] == pytest.approx(0.05)


def test_items_with_their_own_codes_equal_each_alone():
    """Several patch layers in one pass: each item reads its own code (a list of z), and follows
    the trajectory it would alone; h_weight 0 trains on the K/V-space term only."""
    z1, t1, lw1, lb1, wk1 = _data(consumers=1, seed=1)
    z2, t2, lw2, lb2, wk2 = _data(consumers=1, seed=2)
    kw = dict(width=16, steps=120, lr=1e-2, batch=256, aux=1.0, seed=5, eval_every=20, patience=0, h_weight=0.0)
    together = train_aligners([z1, z2], t1 + t2, lw1 + lw2, lb1 + lb2, w_kvs=wk1 + wk2, **kw)
    for (p, r), z, t, lw, lb, wk in ((together[0], z1, t1, lw1, lb1, wk1), (together[1], z2, t2, lw2, lb2, wk2)):
        (alone_p, alone_r), = train_aligners(z, t, lw, lb, w_kvs=wk, **kw)
        assert r["best_step"] == alone_r["best_step"]
        for k in ALIGNER_PARAMS:
            assert torch.allclose(p[k], alone_p[k], atol=1e-5, rtol=1e-4), k
        # the K/V-space error (what the consumer's attention reads) beats the linear start's
        kv = lambda h: h @ wk[0].T  # noqa: E731
        err = (kv(apply_aligner(p, z)) - kv(t[0])).pow(2).mean()
        assert err < (kv(z @ lw[0] + lb[0]) - kv(t[0])).pow(2).mean()
    with pytest.raises(ValueError, match="codes"):
        train_aligners([z1], t1 + t2, lw1 + lw2, lb1 + lb2, width=4, steps=1)


def test_resume_from_trained_parameters_continues_the_descent():
    """init=: a second call starts from the first's parameters (its held-out loss is the first's
    best, on the same split) and goes lower; the linear start arguments are then unused."""
    z, targets, lin_ws, lin_bs, w_kvs = _data()
    kw = dict(width=16, lr=1e-2, batch=256, aux=1.0, seed=3, eval_every=20, patience=0)
    first = train_aligners(z, targets, lin_ws, lin_bs, w_kvs=w_kvs, steps=60, **kw)
    zeros = [torch.zeros_like(w) for w in lin_ws]
    second = train_aligners(z, targets, zeros, [torch.zeros_like(b) for b in lin_bs], w_kvs=w_kvs, steps=300,
                            init=[p for p, _ in first], **kw)
    for (p1, r1), (p2, r2) in zip(first, second):
        assert r2["val_loss_linear"] == pytest.approx(r1["val_loss_best"], rel=1e-5)
        assert r2["val_loss_best"] < r1["val_loss_best"]
        assert torch.equal(p2["scale"], p1["scale"])  # the codes' normalization is part of the trained map
    with pytest.raises(ValueError, match="init"):
        train_aligners(z, targets, lin_ws, lin_bs, width=8, steps=1, init=[p for p, _ in first])
