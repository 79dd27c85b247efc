"""benchmarks/fusedkv: the compact LM against transformers' Llama, parameter matching, LoRA merge,
the converted-model builder, and train.py / retrofit.py end to end at toy size (a synthetic
token dir with a small vocabulary, a tiny random Llama dir)."""
from __future__ import annotations

import json
import lzma
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "benchmarks", "fusedkv"), os.path.join(ROOT, "benchmarks")]
from build_model import build_converted, load_lm  # noqa: E402
from model import LM, LMConfig, apply_lora, lora_state, matched_recon_intermediate, merge_lora_into, unwrap_lora  # noqa: E402

from sgl_kvxfer.models.fusedkv_math import FusedKVConfig  # noqa: E402

TINY_HF = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True, "max_position_embeddings": 256}


def tiny_model_dir(path, vocab: int) -> str:
    """A random tiny Llama checkpoint (HF names), with SmolLM2's tokenizer files when vocab fits."""
    from safetensors.torch import save_file

    cfg = {**TINY_HF, "vocab_size": vocab}
    m = LM(LMConfig.from_hf_dict(cfg))
    m.init_weights(seed=3, std=0.2)
    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    if vocab == 49152:
        from sgl_kvxfer.models.loader import resolve_model_path

        src = resolve_model_path(None)
        for n in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if os.path.isfile(os.path.join(src, n)):
                with open(os.path.join(src, n), "rb") as a, open(os.path.join(path, n), "wb") as b:
                    b.write(a.read())
    return str(path)


def token_dir(path, vocab: int, n: int = 6000) -> str:
    g = np.random.default_rng(0)
    os.makedirs(path, exist_ok=True)
    for domain in ("prose", "code"):
        for split in ("train", "calib", "eval"):
            # a learnable stream: mostly the previous token + 1
            x = np.cumsum(g.integers(0, 3, n)) % vocab
            with open(os.path.join(path, f"{domain}_{split}.u16.xz"), "wb") as f:
                f.write(lzma.compress(x.astype(np.uint16).tobytes()))
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump({"vocab_size": vocab, "files": {}}, f)
    return str(path)


def test_compact_lm_matches_transformers_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = {**TINY_HF, "vocab_size": 300}
    hf = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    m = LM(LMConfig.from_hf_dict(cfg))
    sd = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    m.load_state_dict(sd, strict=True)
    ids = torch.randint(0, 300, (2, 37), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(m(ids), hf(ids).logits, rtol=1e-4, atol=1e-4)


def test_param_matching_and_fusedkv_forward():
    base = LMConfig(vocab_size=100, hidden_size=64, num_layers=6, num_heads=4, num_kv_heads=4, head_dim=16,
                    intermediate_size=128)
    n0 = LM(base).param_counts()["total"]
    for variant in ("fusedkv", "lite"):
        fk = FusedKVConfig(num_hidden_layers=6, variant=variant)
        m = LM(base.with_fusedkv(fk, matched_recon_intermediate(base, fk)))
        pc = m.param_counts()
        assert abs(pc["total"] - n0) <= 3 * 64 * 3 / 2 and pc["kv_proj"] == 3 * 2 * 64 * 64
        m.init_weights()
        logits, kv = m(torch.randint(0, 100, (2, 9)), return_kv=True)
        assert logits.shape == (2, 9, 100) and sorted(kv) == [0, 1, 2]
    assert LM(base).kv_bytes_per_token() == 2 * LM(base.with_fusedkv(FusedKVConfig(num_hidden_layers=6))).kv_bytes_per_token()


def test_lite_top_layers_attend_shared_kv():
    """Lite's top layers attend over exactly K of the last storage layer and V of layer 0."""
    c = LMConfig(vocab_size=50, hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=2, head_dim=16,
                 intermediate_size=32, fusedkv=FusedKVConfig(num_hidden_layers=4, variant="lite"))
    m = LM(c)
    m.init_weights()
    seen = {}
    attn = m.model.layers[3].self_attn
    orig = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.setdefault("kv", []).append((k, v))
        return orig(q, k, v, **kw)

    torch.nn.functional.scaled_dot_product_attention = spy
    try:
        _, kv = m(torch.randint(0, 50, (1, 5)), return_kv=True)
    finally:
        torch.nn.functional.scaled_dot_product_attention = orig
    k3, v3 = seen["kv"][3]
    assert torch.equal(k3, kv[1][0].transpose(1, 2)) and torch.equal(v3, kv[0][1].transpose(1, 2))
    assert not hasattr(attn, "k_proj") and not hasattr(attn, "kv_fusion")


def test_lora_merge_equals_wrapped_model():
    c = LMConfig(vocab_size=60, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                 intermediate_size=48)
    m = LM(c)
    m.init_weights()
    base_sd = {k: v.clone() for k, v in m.state_dict().items()}
    apply_lora(m, rank=4, alpha=8)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("lora_B"):
                p.normal_()
    ids = torch.randint(0, 60, (1, 7))
    with torch.no_grad():
        want = m(ids)
    merged = dict(base_sd)
    merge_lora_into(merged, lora_state(m), 8 / 4)
    m2 = LM(c)
    m2.load_state_dict(merged)
    with torch.no_grad():
        torch.testing.assert_close(m2(ids), want, rtol=1e-4, atol=1e-4)
    unwrap_lora(m)
    assert set(m.state_dict()) == set(base_sd)
    with torch.no_grad():
        torch.testing.assert_close(m(ids), want, rtol=1e-4, atol=1e-4)


def test_build_converted_roundtrip(tmp_path):
    from safetensors.torch import save_file

    from build_model import fingerprint, load_base

    base = tiny_model_dir(tmp_path / "base", vocab=80)
    _, base_sd = load_base(base)
    fk = FusedKVConfig(num_hidden_layers=4)
    small = {"model.layers.2.self_attn.kv_fusion.key_pair_weight": torch.randn(2, 2, 8),
             "model.layers.2.self_attn.kv_fusion.value_weight": torch.randn(2, 2, 16),
             "model.layers.3.self_attn.kv_fusion.key_pair_weight": torch.randn(2, 2, 8),
             "model.layers.3.self_attn.kv_fusion.value_weight": torch.randn(2, 2, 16),
             "model.norm.weight": torch.full((32,), 2.0),
             "model.layers.0.mlp.up_proj.lora_A": torch.randn(4, 32),
             "model.layers.0.mlp.up_proj.lora_B": torch.randn(64, 4)}
    meta = {"fusedkv": json.dumps(fk.to_dict()), "lora_scale": "0.5", "base_fingerprint": fingerprint(base_sd)}
    save_file(small, str(tmp_path / "w.safetensors"), metadata=meta)
    out = build_converted(str(tmp_path / "w.safetensors"), str(tmp_path / "conv"), base)
    m = load_lm(out)
    assert m.config.fusedkv == fk and not hasattr(m.model.layers[3].self_attn, "k_proj")
    assert torch.equal(m.model.norm.weight, small["model.norm.weight"])
    want = base_sd["model.layers.0.mlp.up_proj.weight"] + 0.5 * small["model.layers.0.mlp.up_proj.lora_B"] @ small[
        "model.layers.0.mlp.up_proj.lora_A"]
    torch.testing.assert_close(m.model.layers[0].mlp.up_proj.weight, want)
    save_file(small, str(tmp_path / "w2.safetensors"), metadata={**meta, "base_fingerprint": "0" * 64})
    with pytest.raises(ValueError, match="fingerprint"):
        build_converted(str(tmp_path / "w2.safetensors"), str(tmp_path / "conv2"), base)


def _run(script, args, tmp_path, timeout=300):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    cmd = [sys.executable, os.path.join("benchmarks", "fusedkv", script), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return proc.stdout


@pytest.mark.slow
def test_train_toy_end_to_end(tmp_path):
    data = token_dir(tmp_path / "tok", vocab=256)
    out = tmp_path / "out"
    _run("train.py", ["--preset", "toy", "--device", "cpu", "--data-dir", data, "--out-dir", str(out)], tmp_path)
    res = json.load(open(out / "fusedkv_train_toy_cpu.json"))
    assert res["device"] and res["commit"] and res["command"] and os.path.isfile(out / "fusedkv_train_toy_cpu.png")
    assert set(res["models"]) == {"vanilla", "fusedkv", "lite"} and res["steps"] == 8
    for r in res["models"].values():
        assert len(r["train_loss"]) == 8 and r["final_val_loss"] > 0 and abs(
            r["params"]["total"] / res["models"]["vanilla"]["params"]["total"] - 1) < 1e-3
    assert res["models"]["lite"]["kv_bytes_per_token_bf16"] * 2 == res["models"]["vanilla"]["kv_bytes_per_token_bf16"]


@pytest.mark.slow
def test_retrofit_toy_end_to_end(tmp_path):
    model = tiny_model_dir(tmp_path / "m", vocab=49152)
    data = token_dir(tmp_path / "tok", vocab=49152, n=600)
    out = tmp_path / "out"
    log = _run("retrofit.py", ["--preset", "toy", "--device", "cpu", "--model", model, "--data-dir", data,
                               "--out-dir", str(out), "--time-budget-s", "0"], tmp_path)
    res = json.load(open(out / "fusedkv_retrofit_toy_cpu.json"))
    assert os.path.isfile(out / "fusedkv_retrofit_toy_cpu.png") and res["steps_done"] == [2, 2]
    assert [c["stage"] for c in res["curve"][:3]] == ["original", "lite", "lstsq"]
    # the rebuilt dir scores what the tuned student scored (same device, same dtype)
    assert abs(res["reloaded_ppl"] / res["final_ppl"] - 1) < 1e-3, log
    assert len(res["answers"]) == 4 and {"original", "fusedkv"} <= set(res["answers"][0])
    assert os.path.getsize(out / res["weights_file"]) == res["weights_file_bytes"] < 16 << 20
