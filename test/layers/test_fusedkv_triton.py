"""FusedKV's triton path in the engine (kernels/fusedkv_attention.py over the paged fp16 pool),
float16 (the CPU interpreter's bf16 tl.dot is wrong for the storage layers' kernels: see
test_triton_backend.py), against the torch backend on the same checkpoint. On CPU the kernels
run under TRITON_INTERPRET=1 (tiny shapes); on a GPU the same tests run natively.

- last-token prefill (the decode kernel over each prompt's last token), prompt logprobs (the
  extend kernel over each request's logits rows) and decode;
- the CUDA-graph capture target (CudaGraphRunner.decode_step_static; eager replay on CPU):
  fixed-width block tables, even splits, padding rows.
"""
import random

import pytest
import torch
from fusedkv_helpers import TINY, write_model
from greedy_checks import assert_greedy_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ATOL = 2e-2  # logprobs: fp16 attention with different summation orders
KW = dict(dtype="float16", device=DEVICE, max_total_tokens=1024, chunked_prefill_size=64, max_running_requests=4)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    base = {**TINY, "torch_dtype": "float16", "head_dim": 32, "hidden_size": 128}
    return {v: write_model(str(tmp_path_factory.mktemp(f"fkv_triton_{v}")), v, seed=9, base=base)
            for v in ("fusedkv", "lite")}


def _count_kernel_calls(backend) -> dict:
    """Wrap the backend's kernel module: calls per launcher."""
    from types import SimpleNamespace

    calls, mod = {"decode": 0, "extend": 0}, backend._kernels

    def counted(name, fn):
        def run(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return run

    backend._kernels = SimpleNamespace(plan_fusedkv_splits=mod.plan_fusedkv_splits,
                                       fusedkv_decode_attention=counted("decode", mod.fusedkv_decode_attention),
                                       fusedkv_extend_attention=counted("extend", mod.fusedkv_extend_attention))
    return calls


def _prompts():
    rng = random.Random(3)
    return [[rng.randrange(3, TINY["vocab_size"]) for _ in range(n)] for n in (45, 33)]


def _compare(got, want):
    """Prompt logprobs within ATOL; outputs the same up to a near tie, logprobs within ATOL until then."""
    for g, r in zip(got, want):
        gl = [e[0] for e in g["meta_info"]["input_token_logprobs"] if e[0] is not None]
        rl = [e[0] for e in r["meta_info"]["input_token_logprobs"] if e[0] is not None]
        assert len(gl) == len(rl) and (not gl or max(abs(a - b) for a, b in zip(gl, rl)) < ATOL)
    assert_greedy_close(got, want, ATOL)


@pytest.mark.parametrize("variant", ("fusedkv", "lite"))
def test_triton_path_matches_torch(model_dirs, variant):
    from sgl_kvxfer import Engine

    model_dir, prompts = model_dirs[variant], _prompts()
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    out = {}
    for backend in ("torch", "triton"):
        # eager decode: a replayed CUDA graph calls no launcher, so the count below needs none
        with Engine(model_dir, attention_backend=backend, disable_cuda_graph=True, **KW) as eng:
            assert eng.runner.attn_backend.path == backend
            calls = _count_kernel_calls(eng.runner.attn_backend) if backend == "triton" else None
            last = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=2)
            eng.flush_cache()
            if calls is not None:  # prefill (last rows) and 5 decode steps: the decode kernel, 2 layers each
                assert calls == {"decode": 12, "extend": 0}, calls
            lp = eng.generate(input_ids=prompts, sampling_params={**params, "max_new_tokens": 2},
                              return_logprob=True, logprob_start_len=20, top_logprobs_num=2)
            if calls is not None:  # prompt logprob rows: the extend kernel
                assert calls["extend"] >= 2, calls
            eng.flush_cache()  # scoring only: rows stop one short of the last token
            scored = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                                  logprob_start_len=3)
            out[backend] = last + lp + scored
            eng.runner.allocator.debug_check()
    _compare(out["triton"], out["torch"])


@pytest.mark.heavy  # over 10 s on 2 cores: CI leaves it out (README, Tests)
def test_graph_capture_target_matches_eager(model_dirs):
    from sgl_kvxfer import Engine
    from sgl_kvxfer.engine.cuda_graph_runner import CudaGraphRunner

    model_dir = model_dirs["fusedkv"]
    prompts = _prompts() + [[5, 6, 7]]
    params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in (5, 3, 7)]
    with Engine(model_dir, attention_backend="triton", disable_cuda_graph=True, **KW) as eng:
        runner = eng.runner
        assert runner.attn_backend.supports_cuda_graph
        eager = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        eng.flush_cache()
        runner.graph_runner = static = CudaGraphRunner(runner, max_bs=4, use_graphs=False)
        graphed = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        assert static.replays == 6
    for e, g in zip(eager, graphed):
        assert e["output_ids"] == g["output_ids"]
        el, gl = e["meta_info"]["output_token_logprobs"], g["meta_info"]["output_token_logprobs"]
        assert max(abs(a[0] - b[0]) for a, b in zip(el, gl)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ("fusedkv", "lite"))
def test_gpu_graphs_match_eager_smollm2_shape(tmp_path, variant):
    """SmolLM2-shaped FusedKV / Lite (30 layers, 9 q / 3 kv heads, D 64), bf16, dummy weights:
    decode replayed from CUDA graphs vs --disable-cuda-graph, and the triton path vs torch."""
    import json

    from sgl_kvxfer import Engine
    from sgl_kvxfer.models.presets import PRESETS, write_dummy_tokenizer

    cfg = {**PRESETS["smollm2-135m"], "fusedkv": {"variant": variant}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model_dir = write_dummy_tokenizer(str(tmp_path), cfg["vocab_size"])
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 49000) for _ in range(rng.randrange(20, 600))] for _ in range(8)]
    params = [{"max_new_tokens": 8 + 3 * i, "temperature": 0, "ignore_eos": True} for i in range(8)]
    out = {}
    for name, kw in (("graphs", {}), ("eager", {"disable_cuda_graph": True}),
                     ("torch", {"attention_backend": "torch", "disable_cuda_graph": True})):
        with Engine(model_dir, load_format="dummy", dtype="bfloat16", max_total_tokens=16384,
                    max_running_requests=8, cuda_graph_max_bs=8, **{"attention_backend": "triton", **kw}) as eng:
            assert (eng.runner.graph_runner is not None) == (name == "graphs")
            out[name] = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True,
                                     top_logprobs_num=2)
            if name == "graphs":
                assert eng.runner.graph_runner.replays > 20
    for name in ("graphs", "torch"):
        assert_greedy_close(out[name], out["eager"], 0.1)


def test_rope_q_fused_kernel_matches_torch(monkeypatch):
    """Reconstruction layers rotate q alone: the fused RoPE kernel with zero k heads."""
    from sgl_kvxfer.kernels.testing import assert_rope_close
    from sgl_kvxfer.layers import fused_ops
    from sgl_kvxfer.layers.rope import apply_rope
    from sgl_kvxfer.models.fusedkv_llama import rope_q

    g = torch.Generator().manual_seed(0)
    q, cos, sin = (torch.randn(shape, generator=g).half().to(DEVICE) for shape in ((7, 4, 32), (7, 1, 16), (7, 1, 16)))
    monkeypatch.setattr(fused_ops, "wants_fused", lambda device_type, dtype: True)
    # bitwise under the interpreter; compiled, within the rounding bound (products may contract)
    assert_rope_close(rope_q(q, cos, sin), apply_rope(q, cos, sin), q, cos, sin)


@pytest.mark.heavy  # over 10 s on 2 cores: CI leaves it out (README, Tests)
@pytest.mark.parametrize("variant", ("fusedkv", "lite"))
def test_tiered_kernel_path_matches_torch(model_dirs, variant):
    """Over a tiered pool (b = 0.5, int8 and int4 tokens) the Triton tiered backend serves the
    storage layers and kernels/fusedkv_tiered_decode.py the reconstruction layers' decode and
    prefill-skip rows (`triton-tiered`), against the torch backend on the same checkpoint; the
    graph capture target (eager replay on CPU) gives the eager tokens."""
    from sgl_kvxfer import Engine
    from sgl_kvxfer.engine.cuda_graph_runner import CudaGraphRunner
    from sgl_kvxfer.spectrum.tiers import TIER_INT4, TIER_INT8

    prompts = _prompts()
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    tiers = dict(kv_tier_budget=0.5, kv_int4="on", kv_decode_recent=4, kv_quant_group_size=16, kv_tier_page_size=16)
    out = {}
    for backend in ("torch", "triton"):
        with Engine(model_dirs[variant], attention_backend=backend, disable_cuda_graph=True, **tiers, **KW) as eng:
            fkv = eng.runner.attn_backend
            assert fkv.path == ("triton-tiered" if backend == "triton" else "torch")
            out[backend] = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
            used = eng.runner.allocator.used_counts()
            assert used[TIER_INT8] > 0 and used[TIER_INT4] > 0, used
            if backend == "triton":
                eng.flush_cache()
                eng.runner.graph_runner = static = CudaGraphRunner(eng.runner, max_bs=4, use_graphs=False)
                graphed = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
                assert static.replays >= 5
                assert [g["output_ids"] for g in graphed] == [o["output_ids"] for o in out["triton"]]
            eng.runner.allocator.debug_check()
    _compare(out["triton"], out["torch"])
