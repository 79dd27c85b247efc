"""The specialist trainer at toy size on CPU: deterministic for a seed, adapter loadable by --merge-lora."""
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts", "scd"))

import train_specialist  # noqa: E402


def test_train_toy_specialist_deterministic(tiny_pair, tmp_path):
    from safetensors.torch import load_file

    from sgl_kvxfer.models.loader import load_model

    data = tmp_path / "toy_train.jsonl"
    data.write_text("".join(json.dumps({"text": " ".join(f"word{(i * j) % 97}" for j in range(60))}) + "\n"
                            for i in range(8)))
    outs = []
    for run in range(2):
        out = str(tmp_path / f"spec{run}")
        train_specialist.main(["--name", "toy", "--data", str(data), "--model", tiny_pair["producer"], "--out-dir", out,
                               "--steps", "3", "--batch-size", "2", "--seq-len", "16", "--warmup", "1", "--rank", "4",
                               "--device", "cpu", "--dtype", "float32", "--seed", "7"])
        outs.append(out)
    a, b = (load_file(os.path.join(o, "adapter_model.safetensors")) for o in outs)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(t.dtype == torch.bfloat16 for t in a.values())
    assert len([k for k in a if "lora_A" in k]) == 4 * 7  # every projection of every layer
    log = json.load(open(os.path.join(outs[0], "train_log.json")))
    assert len(log["loss"]) == 3 and log["params"]["seed"] == 7 and os.path.isfile(os.path.join(outs[0], "loss.png"))
    merged, _ = load_model(tiny_pair["producer"], "auto", torch.float32, "cpu", 0, merge_lora=outs[0])
    base, _ = load_model(tiny_pair["producer"], "auto", torch.float32, "cpu", 0)
    assert not torch.equal(merged.model.layers[0].mlp.down_proj.weight, base.model.layers[0].mlp.down_proj.weight)
