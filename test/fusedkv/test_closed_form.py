"""sgl_kvxfer/fusedkv/closed_form.py: the RoPE-aware key fit recovers planted weights and rotations
and agrees before and after RoPE, the query fold reproduces the rotated keys' scores, the value ALS
recovers a planted (b, M) structure, and the whole init on a tiny LM lowers the attention-output
error it reports."""
from __future__ import annotations

import contextlib

import torch

from sgl_kvxfer.fusedkv.closed_form import (KeyPairStats, ValueCov, as_complex_pairs, closed_form_init,
                                            fold_query_rotation)
from sgl_kvxfer.fusedkv.model import LM, LMConfig, rope
from sgl_kvxfer.models.fusedkv_math import expand_key_weight

H, D, T = 2, 8, 400


def _rotate(k: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """k [T, H, D] times the complex c [H, D/2] per rotary pair (half-split layout)."""
    z = as_complex_pairs(k) * c
    return torch.cat([z.real, z.imag], -1).to(k.dtype)


def _planted(seed=0):
    g = torch.Generator().manual_seed(seed)
    k0, k1 = torch.randn(T, H, D, generator=g), torch.randn(T, H, D, generator=g)
    a = torch.randn(2, H, D // 2, generator=g)
    phi = torch.rand(H, D // 2, generator=g) * 6.0 - 3.0
    c = torch.polar(torch.ones_like(phi), phi).to(torch.complex128)
    w = expand_key_weight(a)
    y = _rotate(w[0] * k0 + w[1] * k1, c)
    return k0, k1, y, a, c


def _same_up_to_sign(a_got, c_got, a, c):
    sign = torch.sign((a_got * a).sum(0))  # the eigenvector's sign is free: (a, c) and (-a, -c) are one fit
    torch.testing.assert_close(a_got * sign, a, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(c_got * sign, c, atol=1e-4, rtol=1e-4)


def test_key_fit_recovers_planted_weights_and_rotations():
    k0, k1, y, a, c = _planted()
    st = KeyPairStats()
    st.update(k0[:200], k1[:200], y[:200])  # two updates == one over all tokens
    st.update(k0[200:], k1[200:], y[200:])
    a_got, c_got, res = st.solve()
    _same_up_to_sign(a_got, c_got, a, c)
    assert float(res.sum() / st.Y.sum()) < 1e-5  # float32 samples, the 1e-6 relative ridge


def test_key_fit_is_the_same_before_and_after_rope():
    k0, k1, y, _, _ = _planted(1)
    y = y + 0.3 * torch.randn(y.shape, generator=torch.Generator().manual_seed(5))  # not exactly representable
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    freqs = torch.arange(T).float()[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
    post = [rope(x[None], cos, sin)[0] for x in (k0, k1, y)]
    pre_fit, post_fit = KeyPairStats(), KeyPairStats()
    pre_fit.update(k0, k1, y)
    post_fit.update(*post)
    a_pre, c_pre, r_pre = pre_fit.solve()
    a_post, c_post, r_post = post_fit.solve()
    _same_up_to_sign(a_post, c_post, a_pre, c_pre)
    torch.testing.assert_close(r_post, r_pre, atol=1e-6, rtol=1e-6)
    assert float(r_pre.sum() / pre_fit.Y.sum()) > 0.01  # a real fit, not a planted exact one


def test_query_fold_gives_the_scores_of_the_rotated_keys():
    g = torch.Generator().manual_seed(2)
    Hq, hidden = 4, 16
    wq = torch.randn(Hq * D, hidden, generator=g)
    x = torch.randn(5, hidden, generator=g)
    k = torch.randn(5, H, D, generator=g)
    c = torch.polar(torch.rand(H, D // 2, generator=g) + 0.5, torch.rand(H, D // 2, generator=g) * 6).to(torch.complex128)
    q = (x @ wq.T).view(5, Hq, D)
    q_folded = (x @ fold_query_rotation(wq, c, Hq).T).view(5, Hq, D)
    k_rot = _rotate(k, c).float()
    group = torch.arange(Hq) // (Hq // H)
    want = torch.einsum("shd,thd->hst", q, k_rot[:, group])  # teacher scores over c * K~
    got = torch.einsum("shd,thd->hst", q_folded, k[:, group])  # folded queries over K~ itself
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_value_als_recovers_a_planted_fused_then_mixed_value():
    g = torch.Generator().manual_seed(3)
    v0, v1 = torch.randn(T, H, D, generator=g), torch.randn(T, H, D, generator=g)
    b = torch.randn(2, H, D, generator=g)
    M = torch.randn(H, D, D, generator=g)
    y = torch.einsum("thd,hde->the", b[0] * v0 + b[1] * v1, M)
    cov = ValueCov()
    cov.update(v0, v1, y)
    b_got, res, tot = cov.solve(iters=30)
    assert float(res.sum() / tot.sum()) < 1e-6
    # b is found up to one scale per channel (diag(s) moves into M): the mix b1 / b0 is what is fixed
    torch.testing.assert_close(b_got[1] / b_got[0], b[1] / b[0], atol=1e-3, rtol=1e-2)


def test_closed_form_init_on_a_tiny_lm_lowers_the_attention_error():
    c = LMConfig(vocab_size=40, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8,
                 intermediate_size=48)
    teacher = LM(c)
    teacher.init_weights(seed=1, std=0.1)
    teacher.requires_grad_(False)
    student = LM(c.with_layout("fusedkv", source_layers=(0, 1), init="lite"))
    student.init_weights()
    student.load_state_dict({k: v for k, v in teacher.state_dict().items() if k in student.state_dict()}, strict=False)
    calib = torch.randint(0, 40, (8, 33), generator=torch.Generator().manual_seed(0))
    fit = closed_form_init(teacher, student, calib, 4, contextlib.nullcontext)
    assert sorted(fit) == [2, 3]
    for row in fit.values():
        assert 0 <= row["o_rel_sq_err"] < row["o_rel_sq_err_before"]
        assert 0 <= row["k_rel_sq_err"] <= 1 and 0 <= row["v_rel_sq_err"] <= 1
    assert all(torch.isfinite(p).all() for p in student.parameters())
