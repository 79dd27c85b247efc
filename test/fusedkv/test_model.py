"""sgl_kvxfer/fusedkv/model.py and checkpoint.py: the compact LM against transformers' Llama, every
cross-layer layout's sharing and parameter matching, model dirs out and back in, and the engine
serving a saved dir with the logits the compact LM computes."""
from __future__ import annotations

import pytest
import torch
from fkv_tiny import TINY_HF, tiny_model_dir

from sgl_kvxfer.fusedkv.checkpoint import load_base, load_lm, save_model_dir
from sgl_kvxfer.fusedkv.model import LAYOUTS, LM, LMConfig, matched_recon_intermediate


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


@pytest.mark.parametrize("layout", LAYOUTS)
def test_param_matching_and_equal_kv_bytes(layout):
    base = LMConfig(vocab_size=100, hidden_size=64, num_layers=6, num_heads=4, num_kv_heads=4, head_dim=16,
                    intermediate_size=128)
    n0 = LM(base).param_counts()["total"]
    m = LM(base.with_layout(layout, matched_recon_intermediate(base, layout)))
    pc = m.param_counts()
    assert abs(pc["total"] - n0) <= 3 * 64 * 3 / 2  # half an MLP unit per widened layer
    stored = 6 if layout == "vanilla" else 3
    assert pc["kv_proj"] == stored * 2 * 64 * 64 and m.kv_bytes_per_token() * 6 == LM(base).kv_bytes_per_token() * stored
    m.init_weights()
    hidden: list = []
    logits, kv = m(torch.randint(0, 100, (2, 9)), return_kv=True, hidden_out=hidden)
    assert logits.shape == (2, 9, 100) and len(kv) == stored and len(hidden) == 6


def _spy_attention(m, ids):
    """(K, V) every layer attended over, in layer order, and the stored {layer: (K, V)}."""
    seen = []
    orig = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append((k.transpose(1, 2), v.transpose(1, 2)))
        return orig(q, k, v, **kw)

    torch.nn.functional.scaled_dot_product_attention = spy
    try:
        _, kv = m(ids, return_kv=True)
    finally:
        torch.nn.functional.scaled_dot_product_attention = orig
    return seen, kv


@pytest.mark.parametrize("layout,want", [
    ("lite", {2: (1, 0), 3: (1, 0)}),      # K from the last storage layer, V from layer 0
    ("yoco", {2: (1, 1), 3: (1, 1)}),      # both from the middle
    ("cla2", {1: (0, 0), 3: (2, 2)}),      # odd layers from the one below
])
def test_sharing_layouts_attend_the_right_caches(layout, want):
    c = LMConfig(vocab_size=50, hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=2, head_dim=16,
                 intermediate_size=32).with_layout(layout)
    m = LM(c)
    m.init_weights()
    seen, kv = _spy_attention(m, torch.randint(0, 50, (1, 5)))
    for layer, (ks, vs) in want.items():
        assert torch.equal(seen[layer][0], kv[ks][0]) and torch.equal(seen[layer][1], kv[vs][1])
        attn = m.model.layers[layer].self_attn
        assert not hasattr(attn, "k_proj") and not hasattr(attn, "kv_fusion")
    assert sorted(kv) == sorted(set(range(4)) - set(want))


def test_layout_validation():
    c = LMConfig(vocab_size=50, hidden_size=32, num_layers=3, num_heads=2, num_kv_heads=2, head_dim=16,
                 intermediate_size=32)
    with pytest.raises(ValueError, match="even layer count"):
        c.with_layout("cla2")
    with pytest.raises(ValueError, match="layout must be"):
        c.with_layout("gqa")


@pytest.mark.parametrize("variant", ["fusedkv", "lite"])
def test_saved_dir_loads_back_and_the_engine_serves_it(tmp_path, variant):
    base = tiny_model_dir(tmp_path / "base", vocab=64)
    teacher = load_lm(base)
    m = LM(teacher.config.with_layout(variant, source_layers=(0, 1)))
    m.init_weights(seed=5)
    out = save_model_dir(m, base, str(tmp_path / "conv"))
    cfg, tensors = load_base(out)
    assert cfg["fusedkv"]["variant"] == variant and cfg["fusedkv"]["source_layers"] == [0, 1]
    assert "model.layers.3.self_attn.k_proj.weight" not in tensors
    assert all(t.dtype == torch.float32 for t in tensors.values())
    back = load_lm(out)
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = m(ids)
        torch.testing.assert_close(back(ids), want)

    from sgl_kvxfer import Engine
    from sgl_kvxfer.models.presets import write_dummy_tokenizer

    write_dummy_tokenizer(out, 64)
    with Engine(out, max_total_tokens=256, chunked_prefill_size=64, dtype="float32") as eng:
        got = eng.generate(input_ids=ids[0].tolist(), sampling_params={"max_new_tokens": 0},
                           return_logprob=True, logprob_start_len=1)
    # from logprob_start_len + 1 on, prompt token t is scored from row t - 1
    ref = torch.log_softmax(want[0], -1)
    exp = [float(ref[t - 1, ids[0, t]]) for t in range(2, 12)]
    served = [lp for lp, _, _ in got["meta_info"]["input_token_logprobs"][1:]]
    torch.testing.assert_close(torch.tensor(served), torch.tensor(exp), atol=2e-4, rtol=0)
