"""model.compile_blocks and retrofit.DistillStep: the compiled blocks and losses compute what the
eager ones do, the state dict keeps its names, and the graph count does not grow with depth."""
from __future__ import annotations

import copy

import pytest
import torch

from sgl_kvxfer.fusedkv.distill import distill_loss
from sgl_kvxfer.fusedkv.model import LM, LMConfig, compile_blocks
from sgl_kvxfer.fusedkv.retrofit import DistillStep, RetrofitConfig, student_from

pytestmark = pytest.mark.slow  # inductor compiles C++ on the CPU: tens of seconds


def _pair(layers: int):
    c = LMConfig(vocab_size=96, hidden_size=32, num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=8,
                 intermediate_size=48)
    teacher = LM(c)
    teacher.init_weights(seed=1, std=0.2)
    teacher.requires_grad_(False)
    student = student_from(teacher, RetrofitConfig(variant="fusedkv"), (0, layers // 2 - 1))
    with torch.no_grad():  # the student must differ from the teacher for a non-zero loss
        for p in student.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return teacher, student


@pytest.mark.heavy  # tens of seconds on 2 cores; CI runs -m "not heavy" (README, Tests)
def test_compiled_distill_step_matches_eager_and_keeps_names():
    teacher, student = _pair(4)
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(0))
    cfg = RetrofitConfig(variant="fusedkv")
    eager_s, eager_t = copy.deepcopy(student), copy.deepcopy(teacher)
    names = list(student.state_dict())
    loss_e, _ = distill_loss(eager_s, eager_t, ids, 0.5)
    loss_e.backward()
    compile_blocks(student)
    compile_blocks(teacher)
    loss_c, parts = distill_loss(student, teacher, ids, 0.5, compiled=True)
    loss_c.backward()
    assert loss_e.item() > 1e-4
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-4, atol=1e-6)
    for (n, pe), pc in zip(eager_s.named_parameters(), student.parameters()):
        if pe.grad is not None:
            torch.testing.assert_close(pc.grad, pe.grad, rtol=1e-3, atol=1e-6, msg=n)
    assert list(student.state_dict()) == names
    # DistillStep with compile=True trains: the loss of the same batch goes down
    cfg = RetrofitConfig(variant="fusedkv", compile=True)
    step = DistillStep(student, teacher, cfg, "cpu")
    for g in step.opt.param_groups:
        g["lr"] = 1e-2
    first = step(ids)
    for _ in range(5):
        last = step(ids)
    assert last["kl"] < first["kl"]


@pytest.mark.heavy  # about a minute on 2 cores: CI leaves it out (README, Tests)
def test_compiled_graph_count_does_not_grow_with_depth():
    import torch._dynamo

    counts = []
    for layers in (4, 12):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        teacher, student = _pair(layers)
        compile_blocks(student)
        compile_blocks(teacher)
        ids = torch.randint(0, 96, (1, 16))
        distill_loss(student, teacher, ids, 0.5)[0].backward()
        counts.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert counts[0] == counts[1] and counts[0] <= 8, counts
