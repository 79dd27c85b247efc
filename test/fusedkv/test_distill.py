"""sgl_kvxfer/fusedkv/distill.py: the source search and the least-squares init find planted fusions
exactly, attention-output matching lowers its loss by training only the reconstruction layers, and
the distillation losses vanish for equal models."""
from __future__ import annotations

import contextlib

import pytest
import torch

from sgl_kvxfer.fusedkv.distill import AttentionMatcher, hidden_loss, kl_loss, lstsq_fusion_init, source_search
from sgl_kvxfer.fusedkv.model import LM, LMConfig
from sgl_kvxfer.models.fusedkv_math import expand_key_weight

H, D, L = 2, 8, 6  # kv heads, head dim, layers (storage 0-2, reconstruction 3-5)


class PlantedTeacher(torch.nn.Module):
    """Returns random K/V for layers 0-2 and, for 3-5, the planted function of them."""

    def __init__(self, top):
        super().__init__()
        self.config = LMConfig(vocab_size=10, hidden_size=16, num_layers=L, num_heads=H, num_kv_heads=H,
                               head_dim=D, intermediate_size=8)
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.top, self.g = top, torch.Generator().manual_seed(0)

    def forward(self, ids, return_kv=True):
        B, T = ids.shape
        kv = {i: (torch.randn(B, T, H, D, generator=self.g), torch.randn(B, T, H, D, generator=self.g)) for i in range(3)}
        for i in range(3, L):
            kv[i] = self.top(kv, i)
        return None, kv


def _weights(i):
    g = torch.Generator().manual_seed(i)
    return (expand_key_weight(torch.randn(2, H, D // 2, generator=g)), torch.randn(2, H, D, generator=g))


def _fused(kv, i):  # the FusedKV form over sources (1, 2)
    a, b = _weights(i)
    return a[0] * kv[1][0] + a[1] * kv[2][0], b[0] * kv[1][1] + b[1] * kv[2][1]


def test_source_search_and_lstsq_recover_a_planted_fusion():
    teacher = PlantedTeacher(_fused)
    calib = torch.zeros(8, 17, dtype=torch.long)
    found = source_search(teacher, calib, 4, contextlib.nullcontext, 3, "fusedkv")
    assert found["sources"] == [1, 2] and found["score"] < 1e-6 < found["paper_pair_score"]
    student = LM(teacher.config.with_layout("fusedkv", source_layers=(1, 2)))
    resid = lstsq_fusion_init(teacher, student, calib, 4, contextlib.nullcontext)
    for i in range(3, L):
        got = student.model.layers[i].self_attn.kv_fusion
        a, b = _weights(i)
        torch.testing.assert_close(expand_key_weight(got.key_pair_weight.detach()), a, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got.value_weight.detach(), b, atol=1e-4, rtol=1e-4)
        assert resid[i]["k_rel_sq_err"] < 1e-8 and resid[i]["v_rel_sq_err"] < 1e-8


def test_source_search_for_lite_picks_one_layer_for_k_and_one_for_v():
    teacher = PlantedTeacher(lambda kv, i: (3.0 * kv[2][0], -2.0 * kv[0][1]))
    found = source_search(teacher, torch.zeros(4, 9, dtype=torch.long), 2, contextlib.nullcontext, 3, "lite")
    assert found["sources"] == [0, 2] and found["score"] < 1e-6  # (V source, K source)


def _tiny(layout=None, **kw):
    c = LMConfig(vocab_size=40, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8,
                 intermediate_size=48)
    m = LM(c if layout is None else c.with_layout(layout, **kw))
    m.init_weights(seed=1, std=0.1)
    return m


def test_attention_matching_trains_only_the_reconstruction_layers():
    torch.manual_seed(0)
    teacher = _tiny()
    teacher.requires_grad_(False)
    student = _tiny("fusedkv", init="lite")
    student.load_state_dict({k: v for k, v in teacher.state_dict().items() if k in student.state_dict()}, strict=False)
    before = {k: v.clone() for k, v in student.state_dict().items()}
    m = AttentionMatcher(teacher, student)
    mats, fusion = m.parameters()
    student.requires_grad_(False)
    for p in mats + fusion:
        p.requires_grad_(True)
    opt = torch.optim.Adam(mats + fusion, lr=3e-3)
    ids = torch.randint(0, 40, (4, 16), generator=torch.Generator().manual_seed(2))
    first = m.loss(ids).item()
    for _ in range(30):
        loss = m.loss(ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert m.loss(ids).item() < 0.7 * first
    m.close()
    changed = {k for k, v in student.state_dict().items() if not torch.equal(v, before[k])}
    assert changed and all(k.startswith(("model.layers.2.", "model.layers.3.")) and
                           (".q_proj." in k or ".o_proj." in k or ".kv_fusion." in k) for k in changed)
    assert not teacher.model.layers[2].self_attn._forward_hooks  # close() removed its hooks


def test_losses_vanish_for_equal_models():
    x = torch.randn(2, 5, 11)
    assert kl_loss(x, x).item() == pytest.approx(0.0, abs=1e-6)
    assert kl_loss(x, torch.zeros_like(x)).item() > 0
    h = [torch.randn(2, 5, 4) for _ in range(3)]
    assert hidden_loss(h, h).item() == 0.0 and hidden_loss([t * 2 for t in h], h).item() == pytest.approx(1.0)
