"""retrofit.DistillStep's regularizers: anchor_decay pulls the pretrained weights back towards the
distill phase's start, ema keeps an average that averaged() lends the student and settle() gives it."""
from __future__ import annotations

import pytest
import torch
from fkv_tiny import teacher_student_pair

from sgl_kvxfer.fusedkv.retrofit import DistillStep, RetrofitConfig, student_from


def _pair():
    return teacher_student_pair(0.02)


def _step(student, teacher, lr=1e-2, **kw):
    step = DistillStep(student, teacher, RetrofitConfig(variant="fusedkv", **kw), "cpu")
    for g in step.opt.param_groups:
        g["lr"] = lr
    return step


IDS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))


def test_anchor_decay_pulls_the_pretrained_weights_back():
    torch.manual_seed(0)
    teacher, student = _pair()
    weights = [p.detach().clone() for p in student.parameters()]
    step = _step(student, teacher, lr=1e-2, anchor_decay=100.0)  # lr x decay = 1: all the way back
    start = [p.detach().clone() for p in step.params[0]]
    fusion = [p.detach().clone() for p in step.params[1]]
    step(IDS)
    for p, p0 in zip(step.params[0], start):
        torch.testing.assert_close(p, p0, rtol=0, atol=1e-7)
    assert any(not torch.equal(p, f) for p, f in zip(step.params[1], fusion))  # fusion weights train freely
    plain = _step(*_pair_from(teacher, weights), lr=1e-2)  # without it the same step moves them
    before = [p.detach().clone() for p in plain.params[0]]
    plain(IDS)
    assert any(not torch.allclose(p, b) for p, b in zip(plain.params[0], before))


def _pair_from(teacher, weights):
    student = student_from(teacher, RetrofitConfig(variant="fusedkv"), (0, 1))
    with torch.no_grad():
        for p, w in zip(student.parameters(), weights):
            p.copy_(w)
    return student, teacher


def test_ema_is_lent_then_kept():
    torch.manual_seed(1)
    teacher, student = _pair()
    step = _step(student, teacher, lr=1e-2, ema=0.5)
    params = step.params[0] + step.params[1]
    expect = [p.detach().clone() for p in params]
    for t in range(3):
        step(IDS)
        decay = min(0.5, (1 + t) / (10 + t))
        expect = [decay * e + (1 - decay) * p.detach() for e, p in zip(expect, params)]
    trained = [p.detach().clone() for p in params]
    with step.averaged():
        for p, e in zip(params, expect):
            torch.testing.assert_close(p, e, rtol=1e-5, atol=1e-7)
    for p, w in zip(params, trained):  # given back after the block
        assert torch.equal(p, w)
    assert any(not torch.allclose(w, e) for w, e in zip(trained, expect))
    step.settle()
    for p, e in zip(params, expect):
        torch.testing.assert_close(p, e, rtol=1e-5, atol=1e-7)


def test_without_ema_averaged_and_settle_change_nothing():
    torch.manual_seed(2)
    teacher, student = _pair()
    step = _step(student, teacher)
    step(IDS)
    now = [p.detach().clone() for p in student.parameters()]
    with step.averaged():
        pass
    step.settle()
    assert all(torch.equal(p, w) for p, w in zip(student.parameters(), now))


@pytest.mark.parametrize("bad", [dict(anchor_decay=-1.0), dict(anchor_decay=float("nan")), dict(ema=1.0),
                                 dict(ema=-0.1)])
def test_bad_values_are_refused(bad):
    with pytest.raises(ValueError):
        RetrofitConfig(**bad)


def test_retrofit_runs_with_both(tiny_model, text_data):
    from sgl_kvxfer.fusedkv.data import Tokenized
    from sgl_kvxfer.fusedkv.retrofit import run_retrofit

    cfg = RetrofitConfig(budget_s=3.0, seq=16, batch=2, eval_windows=2, calib_windows=4, eval_points=2,
                         local_frac=0.0, anchor_decay=10.0, ema=0.99)
    _, rep = run_retrofit(tiny_model, Tokenized(text_data, tiny_model), cfg, "cpu", progress=False)
    assert rep["config"]["anchor_decay"] == 10.0 and rep["config"]["ema"] == 0.99
    assert rep["distill_steps"] >= 1 and rep["curve"][-1]["phase"] == "final"


def test_retrofit_leaves_the_teacher_bit_equal(tiny_model, text_data, monkeypatch):
    """The converted model is compared with the original as loaded: no step of the retrofit (init,
    local phase, distillation with both regularizers) may write into the teacher's weights."""
    from sgl_kvxfer.fusedkv import retrofit
    from sgl_kvxfer.fusedkv.data import Tokenized

    seen = {}
    load = retrofit.load_lm

    def spy(*a, **k):
        t = load(*a, **k)
        seen["teacher"], seen["weights"] = t, {n: p.detach().clone() for n, p in t.state_dict().items()}
        return t

    monkeypatch.setattr(retrofit, "load_lm", spy)
    cfg = RetrofitConfig(budget_s=3.0, seq=16, batch=2, eval_windows=2, calib_windows=4, eval_points=2,
                         local_frac=0.2, anchor_decay=1.0, ema=0.9, shift_windows=True)
    _, rep = retrofit.run_retrofit(tiny_model, Tokenized(text_data, tiny_model), cfg, "cpu", progress=False)
    assert rep["distill_steps"] >= 1 and rep["local_steps"] >= 1
    after = seen["teacher"].state_dict()
    assert set(after) == set(seen["weights"])
    assert all(torch.equal(after[n], w) for n, w in seen["weights"].items())
