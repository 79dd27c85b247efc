"""scripts/train/finetune.py at toy size on CPU: seeded, answer-only loss, full and LoRA (merged),
an output dir our engine loads; bad flags refused."""
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts", "train"))

import finetune  # noqa: E402
import make_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    return make_tiny_model.make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "base"), layers=2, hidden=32,
                                           heads=2, kv_heads=1, intermediate=64)


def _run(base, out, method, seed=0):
    return finetune.main(["--model", base, "--mix", "qa=1,code=1", "--out", out, "--method", method, "--steps", "2",
                          "--batch-size", "2", "--lr", "1e-3", "--warmup", "1", "--eval-n", "1", "--lora-rank", "4",
                          "--device", "cpu", "--seed", str(seed), "--save-dtype", "float32"])


@pytest.mark.slow
def test_full_finetune_seeded_and_served(tiny_base, tmp_path):
    from safetensors.torch import load_file

    from sgl_kvxfer.models.loader import load_model

    logs = [_run(tiny_base, str(tmp_path / f"o{i}"), "full") for i in range(2)]
    a, b = (load_file(str(tmp_path / f"o{i}" / "model.safetensors")) for i in range(2))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert logs[0]["loss"] == logs[1]["loss"] and len(logs[0]["loss"]) == 2
    base = load_file(os.path.join(tiny_base, "model.safetensors"))
    assert not torch.equal(a["model.layers.0.self_attn.k_proj.weight"], base["model.layers.0.self_attn.k_proj.weight"])
    log = json.load(open(tmp_path / "o0" / "train_log.json"))
    assert set(log["eval"]) >= {"qa", "code"} and log["examples_per_task"]["qa"] + log["examples_per_task"]["code"] == 4
    model, arch = load_model(str(tmp_path / "o0"), "auto", torch.float32, "cpu", 0)
    assert arch.num_hidden_layers == 2 and os.path.isfile(tmp_path / "o0" / "tokenizer.json")


@pytest.mark.slow
def test_lora_is_merged_into_a_plain_model_dir(tiny_base, tmp_path):
    _run(tiny_base, str(tmp_path / "l"), "lora")
    files = os.listdir(tmp_path / "l")
    assert "model.safetensors" in files and "adapter_config.json" not in files


def test_answer_loss_covers_answers_only(tiny_base):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_base, dtype=torch.float32)
    ids = torch.randint(0, 1000, (2, 12))
    labels = torch.full_like(ids, -100)
    labels[:, 8:] = ids[:, 8:]
    mask = torch.ones_like(ids)
    want = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert torch.allclose(finetune.answer_loss(model, ids, mask, labels), want, atol=1e-5)


@pytest.mark.parametrize("bad", [["--steps", "0"], ["--lr", "nan"], ["--lr", "-1"], ["--mix", "qa=0"],
                                 ["--mix", "poetry"], ["--task-param", "kv.colour=1"], ["--rope-scaling", "[1]"],
                                 ["--time-limit-s", "inf"], ["--batch-size", "-3"]])
def test_bad_flags_are_refused(bad):
    args = ["--mix", "qa", "--out", "/nonexistent/x"]
    args = [a for i, a in enumerate(args) if not (bad[0] in args and (a == bad[0] or args[i - 1] == bad[0]))]
    with pytest.raises(SystemExit):
        finetune.parse_args(args + bad)
