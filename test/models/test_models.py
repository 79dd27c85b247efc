"""Models: arch config parsing, RoPE vs transformers, tiny-model parity, loader paths."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from sgl_kvxfer.layers.attention.base import rotate_and_attend
from sgl_kvxfer.layers.rope import RotaryEmbedding, compute_inv_freq
from sgl_kvxfer.models import MODEL_REGISTRY, create_model
from sgl_kvxfer.models.arch_config import ModelArchConfig
from sgl_kvxfer.models.llama import LlamaForCausalLM
from sgl_kvxfer.models.loader import (
    load_model,
    load_tokenizer,
    resolve_dtype,
    resolve_model_path,
    resolve_tokenizer_path,
)
from sgl_kvxfer.models.presets import write_preset_config


class DenseCausalBackend:
    """Test attention backend: causal SDPA within each sequence of a ragged batch.
    forward_batch.seq_lens lists the token count of each concatenated sequence."""

    forward_qkv = rotate_and_attend

    def __init__(self, config):
        self.num_q_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim

    def forward(self, q, k, v, layer_id, fb):
        outs, start = [], 0
        for n in fb.seq_lens:
            qs, ks, vs = (x[start : start + n].transpose(0, 1) for x in (q, k, v))  # [H, n, D]
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True).transpose(0, 1))
            start += n
        return torch.cat(outs)


def _fb(seq_lens, config):
    return SimpleNamespace(attn_backend=DenseCausalBackend(config), seq_lens=list(seq_lens))


def _ragged_positions(seq_lens):
    return torch.cat([torch.arange(n) for n in seq_lens])


# ---------------------------------------------------------------- (a) config parsing

LLAMA31 = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16",
}


def test_parse_llama31():
    c = ModelArchConfig.from_hf_dict(LLAMA31)
    assert (c.head_dim, c.num_key_value_heads, c.rope_theta) == (128, 8, 500000.0)
    assert c.rope_scaling["rope_type"] == "llama3" and "rope_theta" not in c.rope_scaling
    assert c.eos_token_ids == (128001, 128008, 128009) and c.bos_token_id == 128000
    assert not c.attention_bias and not c.tie_word_embeddings and c.torch_dtype == "bfloat16"
    assert c.q_size == 4096 and c.kv_size == 1024


def test_parse_mistral_and_qwen2():
    mistral = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 131072,
               "hidden_size": 5120, "intermediate_size": 14336, "num_hidden_layers": 40, "num_attention_heads": 32,
               "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 1e6, "eos_token_id": 2,
               "sliding_window": None, "max_position_embeddings": 1024000}
    c = ModelArchConfig.from_hf_dict(mistral)
    assert c.head_dim == 128 and c.q_size == 4096 and c.eos_token_ids == (2,) and c.rope_scaling is None
    qwen2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936,
             "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2, "rope_theta": 1e6, "tie_word_embeddings": True, "sliding_window": 32768,
             "use_sliding_window": False, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                            "original_max_position_embeddings": 32768}}
    q = ModelArchConfig.from_hf_dict(qwen2)
    assert q.attention_bias and not q.o_proj_bias and q.tie_word_embeddings and q.sliding_window is None
    assert q.head_dim == 64 and q.rope_scaling == {"rope_type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 32768}


def test_parse_transformers5_layout_and_errors():
    d = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
         "num_hidden_layers": 1, "num_attention_heads": 2, "dtype": "float32",
         "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}
    c = ModelArchConfig.from_hf_dict(d)
    assert c.architecture == "LlamaForCausalLM" and c.rope_theta == 1e5 and c.rope_scaling is None
    assert c.num_key_value_heads == 2 and c.head_dim == 4 and c.torch_dtype == "float32"
    with pytest.raises(ValueError, match="Unsupported architecture"):
        ModelArchConfig.from_hf_dict({**d, "architectures": ["GPT2LMHeadModel"]})
    assert set(MODEL_REGISTRY) == {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}


# ---------------------------------------------------------------- (b) RoPE vs transformers

ROPE_CASES = [
    ("default", {}),
    ("linear", {"factor": 4.0}),
    ("dynamic", {"factor": 2.0}),
    ("llama3", {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 512}),
    ("yarn", {"factor": 4.0, "original_max_position_embeddings": 512}),
    ("yarn", {"factor": 4.0, "original_max_position_embeddings": 512, "beta_fast": 16, "beta_slow": 2,
              "mscale": 0.707, "mscale_all_dim": 0.707}),
]


@pytest.mark.parametrize("rope_type,params", ROPE_CASES)
def test_rope_matches_transformers(rope_type, params):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    theta, max_pos = 50000.0, 2048
    hf_cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=max_pos,
                         rope_parameters={"rope_type": rope_type, "rope_theta": theta, **params})
    if rope_type == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        ref, ref_attn = LlamaRotaryEmbedding.compute_default_rope_parameters(config=hf_cfg, device="cpu")
    else:
        ref, ref_attn = ROPE_INIT_FUNCTIONS[rope_type](hf_cfg, "cpu")
    scaling = ModelArchConfig.from_hf_dict(hf_cfg.to_dict()).rope_scaling
    ours, attn = compute_inv_freq(64, theta, scaling, max_pos)
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)
    assert attn == pytest.approx(ref_attn)
    cos, sin = RotaryEmbedding(64, theta, scaling, max_pos).cos_sin(torch.tensor([0, 5, 2047]), torch.float32)
    assert cos.shape == (3, 1, 32) and torch.allclose(cos[0], torch.full_like(cos[0], attn))


# ---------------------------------------------------------------- (c) tiny-model parity

def _tiny_hf(kind: str, tie: bool, rope_parameters=None):
    import transformers

    torch.manual_seed(0)
    kw = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=tie)
    kw["rope_parameters"] = rope_parameters or {"rope_type": "default", "rope_theta": 10000.0}
    if kind == "qwen2":
        cfg, cls = transformers.Qwen2Config(**kw), transformers.Qwen2ForCausalLM
    else:
        cfg, cls = transformers.LlamaConfig(**kw), transformers.LlamaForCausalLM
    cfg._attn_implementation = "eager"
    hf = cls(cfg).eval()
    with torch.no_grad():  # biases and norms start at 0/1; randomize so their mapping is tested
        for name, p in hf.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return hf


@pytest.mark.parametrize(
    "kind,tie,rope",
    [
        ("llama", False, None),
        ("llama", True, {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
        ("qwen2", True, None),
    ],
)
def test_tiny_model_matches_transformers(kind, tie, rope):
    hf = _tiny_hf(kind, tie, rope)
    cfg = ModelArchConfig.from_hf_dict(hf.config.to_dict())
    assert cfg.attention_bias == (kind == "qwen2")
    ours = LlamaForCausalLM(cfg).eval()
    ours.load_weights(hf.state_dict().items())
    seq_lens = [13, 7]  # two requests in one ragged batch
    prompts = [torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)) for n in seq_lens]
    with torch.no_grad():
        hidden = ours(torch.cat(prompts), _ragged_positions(seq_lens), _fb(seq_lens, ours.config))
        logits = ours.compute_logits(hidden)
        assert logits.dtype == torch.float32 and logits.shape == (sum(seq_lens), 96)
        for p, got in zip(prompts, logits.split(seq_lens)):
            ref = hf(p[None]).logits[0].float()
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_load_weights_rejects_missing_and_unknown():
    hf = _tiny_hf("llama", False)
    ours = LlamaForCausalLM(ModelArchConfig.from_hf_dict(hf.config.to_dict()))
    sd = hf.state_dict()
    with pytest.raises(ValueError, match="missing"):
        ours.load_weights((k, v) for k, v in sd.items() if "k_proj" not in k)
    with pytest.raises(KeyError):
        ours.load_weights([("model.bogus.weight", torch.zeros(1))])


# ---------------------------------------------------------------- (d) embedded default (slow)

@pytest.mark.slow
def test_embedded_default_matches_transformers(smollm2_path):
    from transformers import AutoModelForCausalLM

    assert resolve_model_path("SmolLM2-135M-Instruct") == smollm2_path
    tok = load_tokenizer(smollm2_path)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    ids = tok("The quick brown fox jumps over the lazy dog while the sun sets behind", return_tensors="pt").input_ids[0]
    ids = torch.cat([ids, ids])[:20]
    model, cfg = load_model(smollm2_path, "auto", torch.float32, "cpu", seed=0)
    assert cfg.tie_word_embeddings and cfg.num_hidden_layers == 30
    hf = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32, local_files_only=True).eval()
    with torch.no_grad():
        ours = model.compute_logits(model(ids, torch.arange(20), _fb([20], model.config)))
        ref = hf(ids[None]).logits[0].float()
    torch.testing.assert_close(ours, ref, atol=1e-3, rtol=1e-3)


# ---------------------------------------------------------------- (e) dummy presets, dtype

def test_dummy_preset_without_weights(tmp_path):
    d = write_preset_config("smollm2-135m", str(tmp_path / "smol"))
    assert os.listdir(d) == ["config.json"]
    m1, cfg = load_model(d, "dummy", torch.float32, "cpu", seed=7)
    assert torch.all(m1.model.norm.weight == 1) and m1.model.layers[3].mlp.down_proj.weight.std() < 0.03
    with torch.no_grad():
        out = m1(torch.tensor([1, 2, 3]), torch.arange(3), _fb([3], m1.config))
    assert out.shape == (3, cfg.hidden_size) and torch.isfinite(out).all()
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    (tiny / "config.json").write_text(json.dumps({**LLAMA31, "hidden_size": 32, "intermediate_size": 64,
                                                   "num_hidden_layers": 2, "vocab_size": 50, "head_dim": 8}))
    a, b = (load_model(str(tiny), "dummy", torch.float32, "cpu", seed=7)[0] for _ in range(2))
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))

    big = write_preset_config("llama-3-8b", str(tmp_path / "l3"))
    cfg8 = ModelArchConfig.from_dir(big)
    meta = create_model(cfg8, torch.bfloat16, "meta")  # shapes only
    n = sum(p.numel() for p in meta.parameters())
    assert 8.0e9 < n < 8.1e9 and cfg8.rope_scaling["rope_type"] == "llama3"
    assert resolve_dtype("auto", cfg8, "cuda") == torch.bfloat16
    assert resolve_dtype("auto", cfg8, "cpu") == torch.float32
    assert resolve_dtype("half", cfg8, "cpu") == torch.float16
    assert resolve_dtype("auto", cfg, "cuda:0") == torch.bfloat16  # preset says bf16


def test_tokenizer_fallback_to_embedded(tmp_path, smollm2_path):
    d = write_preset_config("llama-3-8b", str(tmp_path / "l3"))
    assert resolve_tokenizer_path(d, None) == smollm2_path
    assert resolve_tokenizer_path(smollm2_path, None) == smollm2_path
    from sgl_kvxfer.models.convert import embedded_gguf_path

    # a .gguf path whose cache dir is already complete is not reconverted
    assert resolve_model_path(embedded_gguf_path(), cache_dir=smollm2_path) == smollm2_path


# ---------------------------------------------------------------- (f) path errors

def test_missing_paths_raise(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        resolve_model_path(missing)
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        resolve_model_path(str(tmp_path / "nope.gguf"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model_path(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(write_preset_config("smollm2-135m", str(tmp_path / "w")), "auto", torch.float32, "cpu", 0)
    cfg_only = json.load(open(tmp_path / "w" / "config.json"))
    assert cfg_only["architectures"] == ["LlamaForCausalLM"]


def test_local_dir_named_like_the_embedded_model_is_a_model_dir(tmp_path):
    """A preset config dir called "smollm2-135m" is that directory, not the embedded model
    (which would need the GGUF package, absent on the GPU machine)."""
    d = write_preset_config("smollm2-135m", str(tmp_path / "smollm2-135m"))
    assert resolve_model_path(d) == d
    assert resolve_model_path(d + "/") == os.path.abspath(d)
