"""retrofit.trainable's scopes: which weights the distill phase moves, and that a step under each
scope moves those and leaves every other weight bit-equal."""
from __future__ import annotations

import pytest
import torch
from fkv_tiny import teacher_student_pair

from sgl_kvxfer.fusedkv.retrofit import SCOPES, DistillStep, RetrofitConfig, trainable


def _pair():
    return teacher_student_pair(0.05)


# the expected scope of each parameter name of the 4-layer student (layers 2 and 3 reconstruct)
def _expected(name: str, scope: str) -> bool:
    return {
        "all": True,
        "blocks": not name.startswith("model.embed_tokens."),
        "attn": ".self_attn." in name,
        "top": name == "model.norm.weight" or name.startswith(("model.layers.2.", "model.layers.3.")),
    }[scope]


@pytest.mark.parametrize("scope", SCOPES)
def test_scope_selects_its_weights(scope):
    _, student = _pair()
    main, fusion = trainable(student, scope)
    chosen = {id(p) for p in main + fusion}
    names = dict(student.named_parameters())
    for name, p in names.items():
        assert (id(p) in chosen) == _expected(name, scope), (scope, name)
        assert p.requires_grad == _expected(name, scope), (scope, name)
    assert all(".kv_fusion." in n for n, p in names.items() if any(p is f for f in fusion))
    assert fusion, "every scope trains the fusion weights"


@pytest.mark.parametrize("scope", SCOPES)
def test_a_step_moves_only_the_scope(scope):
    torch.manual_seed(0)
    teacher, student = _pair()
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    step = DistillStep(student, teacher, RetrofitConfig(variant="fusedkv", train_scope=scope), "cpu")
    for g in step.opt.param_groups:
        g["lr"] = 1e-2
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    step(ids)
    for name, p in student.named_parameters():
        moved = not torch.equal(p.detach(), before[name])
        assert moved == _expected(name, scope), (scope, name, moved)


def test_unknown_scope_is_refused():
    with pytest.raises(ValueError, match="train_scope"):
        RetrofitConfig(train_scope="embeddings")
