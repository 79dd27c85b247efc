"""--attention-backend triton (paged kernels) against the torch backend, through the Engine.

A tiny dummy-weights Llama (2 layers, 4 q / 2 kv heads, head_dim 32) in float16: the Triton CPU
interpreter computes tl.dot wrongly for bf16 (kernels/README.md), so bf16 runs on GPU only.
On CPU the kernels run under TRITON_INTERPRET=1 (set by test/conftest.py), ~1 s per call.
References: torch backend at page 1 (token pool) and page 16 (paged pool, same page size).
"""
import random

import pytest
import torch

from greedy_checks import assert_greedy_close
from tiny_models import tiny_llama

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TINY = tiny_llama()
BACKENDS = {"torch1": ("torch", 1), "torch16": ("torch", 16), "triton16": ("triton", 16)}
ATOL = 2e-2  # logprobs, fp16 attention with different summation orders


def _engine(model_dir, name, dtype="float16", **kw):
    from sgl_kvxfer import Engine

    backend, page = BACKENDS[name]
    return Engine(model_dir, load_format="dummy", dtype=dtype, device=DEVICE, attention_backend=backend,
                  page_size=page, max_total_tokens=2048, chunked_prefill_size=32, **kw)


def _prompts(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in lengths]


def _logprobs(entries):
    return torch.tensor([e[0] for e in entries if e[0] is not None])



def test_prefill_chunked_and_radix_hit_match_torch(tiny_dir):
    """Chunked prefill (chunk 32 over 40 tokens), then a prompt sharing 35 tokens: page 16 serves
    2 whole pages (32) from the radix cache, page 1 serves 35; prompt logprobs after 35 agree."""
    a, tail = _prompts([40, 10], seed=1)
    b = a[:35] + tail
    params = {"max_new_tokens": 1, "temperature": 0}
    out = {}
    for name in BACKENDS:
        with _engine(tiny_dir, name) as eng:
            first = eng.generate(input_ids=a, sampling_params=params, return_logprob=True, logprob_start_len=0)
            second = eng.generate(input_ids=b, sampling_params=params, return_logprob=True, logprob_start_len=35)
            eng.runner.allocator.debug_check()
            out[name] = (first, second)
    assert out["torch1"][1]["meta_info"]["cached_tokens"] == 35
    assert out["torch16"][1]["meta_info"]["cached_tokens"] == out["triton16"][1]["meta_info"]["cached_tokens"] == 32
    ref_a, ref_b = (_logprobs(o["meta_info"]["input_token_logprobs"]) for o in out["torch1"])
    assert ref_a.numel() == 39 and ref_b.numel() >= 9
    for name in ("torch16", "triton16"):
        got_a, got_b = (_logprobs(o["meta_info"]["input_token_logprobs"]) for o in out[name])
        assert torch.allclose(got_a, ref_a, atol=ATOL), (name, (got_a - ref_a).abs().max())
        assert torch.allclose(got_b, ref_b, atol=ATOL), (name, (got_b - ref_b).abs().max())


def test_batched_decode_matches_torch(tiny_dir):
    """Three requests decode together across page boundaries (lengths 13, 30, 5 + 6 tokens)."""
    prompts = _prompts([13, 30, 5], seed=2)
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    out = {}
    for name in BACKENDS:
        with _engine(tiny_dir, name) as eng:
            out[name] = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True,
                                     top_logprobs_num=2)
            eng.flush_cache()
            eng.runner.allocator.debug_check()
            assert eng.runner.allocator.available_size() == eng.runner.max_total_tokens
    assert_greedy_close(out["torch16"], out["torch1"], ATOL)
    assert_greedy_close(out["triton16"], out["torch1"], ATOL)


def test_triton_backend_rejects_fp32_and_bad_page_size(tiny_dir):
    from sgl_kvxfer import Engine
    from sgl_kvxfer.config import EngineConfig

    with pytest.raises(ValueError, match="--dtype float16"):
        _engine(tiny_dir, "triton16", dtype="float32")
    with pytest.raises(ValueError, match="power of two >= 16"):
        Engine(tiny_dir, load_format="dummy", attention_backend="triton", page_size=24)
    assert EngineConfig(attention_backend="triton").resolved_page_size == 64
    assert EngineConfig(attention_backend="torch").resolved_page_size == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_smollm2_shape_triton_vs_torch(tmp_path, dtype):
    """SmolLM2-shaped dummy model (9 q / 3 kv heads, D 64, 30 layers) on GPU at the default page
    size 64: prompt logprobs close, greedy tokens agree up to near ties."""
    from sgl_kvxfer import Engine
    from sgl_kvxfer.models.presets import PRESETS, write_dummy_tokenizer, write_preset_config

    model_dir = write_preset_config("smollm2-135m", str(tmp_path / "smol"))
    write_dummy_tokenizer(model_dir, PRESETS["smollm2-135m"]["vocab_size"])
    prompts = _prompts([100, 300, 70, 200], seed=3)
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    out = {}
    for backend in ("torch", "triton"):
        with Engine(model_dir, load_format="dummy", dtype=dtype, attention_backend=backend,
                    max_total_tokens=8192, chunked_prefill_size=128) as eng:
            assert eng.runner.page_size == (64 if backend == "triton" else 1)
            out[backend] = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True,
                                        logprob_start_len=0, top_logprobs_num=2)
    atol = 0.1 if dtype == "bfloat16" else 2e-2
    for t, r in zip(out["triton"], out["torch"]):
        tl_, rl = _logprobs(t["meta_info"]["input_token_logprobs"]), _logprobs(r["meta_info"]["input_token_logprobs"])
        assert torch.allclose(tl_, rl, atol=atol), (tl_ - rl).abs().max()
        assert abs(t["meta_info"]["output_token_logprobs"][0][0] - r["meta_info"]["output_token_logprobs"][0][0]) < atol


@pytest.mark.heavy  # over 10 s on 2 cores: CI leaves it out (README, Tests)
def test_fused_rope_store_matches_unfused(tiny_dir, monkeypatch):
    """forward_qkv's fused RoPE + KV store (kernels/rope_store.py), forced on under the
    interpreter by treating CPU as CUDA: chunked prefill, a radix hit and a batched decode across
    page boundaries give the unfused path's tokens and logprobs."""
    from sgl_kvxfer.kernels import rope_store
    from sgl_kvxfer.layers import fused_ops

    prompts = _prompts([40, 13, 30], seed=4)
    again = prompts[0][:35] + [7, 8, 9]  # shares two whole pages with the first prompt
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    out, calls = {}, []
    real_wants, real_store = fused_ops.wants_fused, rope_store.rope_store_kv
    for fused in (False, True):
        monkeypatch.setenv("SGL_KVXFER_FUSED_ELEMENTWISE", "1" if fused else "0")
        if fused:
            monkeypatch.setattr(fused_ops, "wants_fused", lambda dev, dt: real_wants("cuda" if dev == "cpu" else dev, dt))
            monkeypatch.setattr(rope_store, "rope_store_kv", lambda *a, **kw: calls.append(kw) or real_store(*a, **kw))
        with _engine(tiny_dir, "triton16") as eng:
            kw = dict(sampling_params=params, return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
            # logprobs from 35 on: the cached pages before it may then be reused
            out[fused] = eng.generate(input_ids=prompts, **kw) + [
                eng.generate(input_ids=again, **{**kw, "logprob_start_len": 35})]
            eng.flush_cache()
            eng.runner.allocator.debug_check()
    assert any(c["return_kv"] for c in calls) and any(not c["return_kv"] for c in calls)  # extend and decode
    assert out[True][3]["meta_info"]["cached_tokens"] == 32
    assert_greedy_close(out[True], out[False], ATOL)
    for g, r in zip(out[True], out[False]):
        gl, rl = _logprobs(g["meta_info"]["input_token_logprobs"]), _logprobs(r["meta_info"]["input_token_logprobs"])
        assert torch.allclose(gl, rl, atol=ATOL), (gl - rl).abs().max()


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU interpreter switch")
def test_cpu_engine_turns_on_the_interpreter_itself(tiny_dir):
    """A fresh process without TRITON_INTERPRET: the Engine sets it before any kernel import."""
    import os
    import subprocess
    import sys

    code = (f"from sgl_kvxfer import Engine\n"
            f"with Engine({tiny_dir!r}, load_format='dummy', dtype='float16', device='cpu', attention_backend='triton', "
            f"page_size=16, max_total_tokens=512) as e:\n"
            f"    out = e.generate(input_ids=[[5, 6, 7]], sampling_params={{'max_new_tokens': 2}})\n"
            f"    print('tokens', len(out[0]['output_ids']))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tokens 2" in proc.stdout
