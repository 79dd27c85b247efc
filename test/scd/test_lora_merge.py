"""--merge-lora: our load-time merge equals peft's merge_and_unload, and the engine serves it."""
import json
import os

import pytest
import torch

from sgl_kvxfer.models.loader import load_model
from sgl_kvxfer.scd import identify
from sgl_kvxfer.scd.calib.forward import LlamaRunner, left_pad


@pytest.fixture(scope="module")
def adapter(tiny_pair, tmp_path_factory):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_pair["producer"], dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # peft inits B = 0 (a no-op adapter); make it do something
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    out = str(tmp_path_factory.mktemp("lora") / "adapter")
    model.save_pretrained(out)
    return out, model.merge_and_unload().eval()


def test_merge_equals_peft(tiny_pair, adapter):
    path, merged_hf = adapter
    ours, arch = load_model(tiny_pair["producer"], "auto", torch.float32, "cpu", 0, merge_lora=path)
    base, _ = load_model(tiny_pair["producer"], "auto", torch.float32, "cpu", 0)
    sd = merged_hf.state_dict()
    q, kv = arch.q_size, arch.kv_size
    w = ours.model.layers[1].self_attn.qkv_proj.weight
    assert torch.allclose(w[q:q + kv], sd["model.layers.1.self_attn.k_proj.weight"], atol=1e-6)
    assert torch.allclose(ours.model.layers[2].mlp.down_proj.weight, sd["model.layers.2.mlp.down_proj.weight"], atol=1e-6)
    assert not torch.allclose(w, base.model.layers[1].self_attn.qkv_proj.weight, atol=1e-3)
    ids, valid, pos = left_pad([list(range(50, 70))])
    logits = LlamaRunner(ours).forward(ids, pos, valid, logits="all").logits[0]
    with torch.no_grad():
        ref = merged_hf(input_ids=ids).logits[0]
    assert torch.allclose(logits, ref, atol=1e-4, rtol=1e-4)
    # the adapter is part of the consumer's identity
    assert identify(tiny_pair["producer"], path).weight_hash != identify(tiny_pair["producer"]).weight_hash


def test_engine_serves_base_plus_adapter(tiny_pair, adapter):
    from sgl_kvxfer import Engine

    path, merged_hf = adapter
    ids = list(range(200, 212))
    eng = Engine(tiny_pair["producer"], device="cpu", dtype="float32", attention_backend="torch",
                 max_total_tokens=128, merge_lora=path)
    try:
        out = eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 4, "temperature": 0})
    finally:
        eng.shutdown()
    with torch.no_grad():
        ref = merged_hf.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)[0, len(ids):].tolist()
    assert out["output_ids"] == ref


def test_bad_adapter_is_refused(tiny_pair, adapter, tmp_path):
    from sgl_kvxfer.config import EngineConfig

    with pytest.raises(ValueError, match="adapter dir"):
        EngineConfig(merge_lora=str(tmp_path))
    path, _ = adapter
    bad = tmp_path / "dora"
    bad.mkdir()
    with open(os.path.join(path, "adapter_config.json")) as f:
        cfg = json.load(f)
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    (bad / "adapter_model.safetensors").write_bytes(open(os.path.join(path, "adapter_model.safetensors"), "rb").read())
    with pytest.raises(ValueError, match="use_dora"):
        load_model(tiny_pair["producer"], "auto", torch.float32, "cpu", 0, merge_lora=str(bad))


def test_model_path_on_an_adapter_points_to_merge_lora(tmp_path, tiny_pair):
    import json

    import pytest

    from sgl_kvxfer.models.loader import resolve_model_path

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": tiny_pair["producer"], "r": 4}))
    with pytest.raises(FileNotFoundError, match=f"--model-path {tiny_pair['producer']} --merge-lora {adapter}"):
        resolve_model_path(str(adapter))
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "HuggingFaceTB/x", "r": 4}))
    with pytest.raises(FileNotFoundError, match="LoRA adapter, not a model.*<its base model dir> --merge-lora"):
        resolve_model_path(str(adapter))
