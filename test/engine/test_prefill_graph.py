"""CUDA-graph prefill (engine/prefill_graph_runner.py): bucket math, the static-buffer path against
the eager extend forward, and (GPU) greedy outputs with prefill graphs on vs off.

On CPU the runner runs in "eager replay" mode (use_graphs=False): `replay` fills the static
buffers (padding tokens and spare request rows included) and calls the capture target
`extend_step_static` directly, so the padding invariants and the tiled attention launch are
checked without CUDA (Triton kernels under TRITON_INTERPRET=1, set by test/conftest.py).
"""
import pytest
import torch

from sgl_kvxfer.engine.prefill_graph_runner import (PrefillGraphRunner, prefill_graph_buckets,
                                                    prefill_graph_unsupported_reason)
from sgl_kvxfer.forward_batch import ForwardMode

from greedy_checks import assert_greedy_close
from test_cuda_graph import (  # noqa: F401  (TINY: the shape the tiny_dir fixture writes)
    ATOL, TINY, _assert_kv_differs_only_in_new_slots, _eager_then_static, _engine, _prompts)


def test_prefill_buckets():
    big = prefill_graph_buckets(32768)
    assert big[:7] == [256, 512, 1024, 2048, 4096, 6144, 8192] and big[-1] == 32768 and len(big) == 19
    assert prefill_graph_buckets(16384)[-2:] == [14336, 16384]
    assert prefill_graph_buckets(5000) == [256, 512, 1024, 2048, 4096, 5000]
    assert prefill_graph_buckets(100) == [100]


def test_flags():
    from sgl_kvxfer.config import EngineConfig
    from sgl_kvxfer.server.flags import parse_server_args

    args = parse_server_args(["--enable-prefill-cuda-graph", "--prefill-cuda-graph-max-tokens", "4096"])
    assert args.engine.enable_prefill_cuda_graph and args.engine.prefill_cuda_graph_max_tokens == 4096
    args = parse_server_args([])
    assert not args.engine.enable_prefill_cuda_graph and args.engine.prefill_cuda_graph_max_tokens is None
    with pytest.raises(ValueError, match="prefill_cuda_graph_max_tokens"):
        EngineConfig(prefill_cuda_graph_max_tokens=8)


def test_off_unless_enabled_and_on_cuda(tiny_dir):
    with _engine(tiny_dir, disable_cuda_graph=True) as eng:
        assert eng.runner.prefill_graph_runner is None
        assert "not enabled" in prefill_graph_unsupported_reason(eng.runner)
    with _engine(tiny_dir, enable_prefill_cuda_graph=True) as eng:
        reason = prefill_graph_unsupported_reason(eng.runner)
        if torch.cuda.is_available():
            assert reason is None and eng.runner.prefill_graph_runner is not None
        else:
            assert "not CUDA" in reason and eng.runner.prefill_graph_runner is None


@pytest.mark.heavy  # about a minute under the interpreter on 2 cores (the static prefill path serves only on CUDA): CI leaves it out (README, Tests)
def test_static_prefill_matches_eager(tiny_dir):
    """Every extend batch runs twice from the same KV state: the eager forward, then the graph
    runner's static path. The batches cover several requests at once, radix-cache prefixes,
    chunked prefill (a request continuing over its own prefix), both buckets, a smaller batch
    after a larger one (stale columns re-padded) and a batch past the largest bucket (eager).
    Logits agree; the KV pool after both is bitwise equal except the new tokens' slots (close)
    and the scratch page; page 0 stays zero."""
    with _engine(tiny_dir, disable_cuda_graph=True, chunked_prefill_size=200) as eng:
        runner = eng.runner
        static = PrefillGraphRunner(runner, max_tokens=384, use_graphs=False)
        assert static.buckets == [256, 384] and static.num_rows == 9
        pool, P = runner.kv_pool, runner.page_size
        scratch_page = pool.scratch_slot // P
        eager_forward, seen = runner.forward, []

        def forward(fb):
            if fb.mode != ForwardMode.EXTEND:
                return eager_forward(fb)
            if not static.can_run(fb):
                seen.append(("eager", fb.num_tokens))
                return eager_forward(fb)
            ref, got, after_eager, after_static = _eager_then_static(pool, fb, eager_forward, static.replay)
            T, tb = fb.num_tokens, static.bucket_for(fb.num_tokens)
            assert bool((static.out_cache_loc[T:tb] == pool.scratch_slot).all())  # padding tokens,
            assert bool((static.positions[T:tb] == 0).all())  # also where an earlier batch was live
            assert int(static.qo_indptr[-1]) == T and int(static.qo_indptr[fb.batch_size]) == T
            assert got.shape == ref.shape
            assert (got - ref).abs().max() < 5e-3, (T, (got - ref).abs().max())
            _assert_kv_differs_only_in_new_slots(after_eager, after_static, fb, P, scratch_page)
            seen.append((tb, T, [int(n) for n in fb.extend_prefix_lens]))
            return got

        runner.forward = forward
        greedy = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
        shared = _prompts([150], seed=1)[0]
        first = eng.generate(input_ids=shared + [5, 6, 7], sampling_params=greedy)
        # a radix hit on `shared`, two fresh prompts, one of 260 tokens chunked at 200
        prompts = [shared + [9, 10, 11, 12]] + _prompts([150, 260], seed=2)
        out = eng.generate(input_ids=prompts, sampling_params=greedy)
        assert [len(o["output_ids"]) for o in [first] + out] == [3, 3, 3, 3]
        assert out[0]["meta_info"]["cached_tokens"] >= 128
        # input logprobs: logits for every prompt position, gathered from the static hidden rows
        lp = eng.generate(input_ids=_prompts([30], seed=4)[0], sampling_params=greedy, return_logprob=True,
                          logprob_start_len=0)
        assert len(lp["meta_info"]["input_token_logprobs"]) == 30
        extend = [s for s in seen if s[0] != "eager"]
        assert any(max(s[2]) > 0 for s in extend), "no batch replayed over a cached prefix"
        assert {s[0] for s in extend} == {256, 384}, seen
        # three 150-token prompts: one 450-token batch, past the largest bucket, runs eager
        eng.generate(input_ids=_prompts([150, 150, 150], seed=3), sampling_params=greedy)
        assert ("eager", 450) in seen, seen
        runner.forward = eager_forward
        eng.flush_cache()
        runner.allocator.debug_check()
        assert runner.allocator.available_size() == runner.max_total_tokens


@pytest.mark.gpu
@pytest.mark.parametrize("preset,dtype", [(None, "float16"), ("smollm2-135m", "bfloat16")])
def test_gpu_prefill_graphs_match_eager(tmp_path, tiny_dir, preset, dtype):
    """Prefill graphs on vs off (decode graphs on in both): 12 requests of 5-700 tokens, a shared
    prefix for radix hits, chunked prefill at 512 and a max token bucket of 1024, so batches
    land in several buckets and the largest go eager."""
    import random

    from sgl_kvxfer.models.presets import PRESETS, write_dummy_tokenizer, write_preset_config

    model_dir, vocab = tiny_dir, TINY["vocab_size"]
    if preset is not None:
        model_dir = write_preset_config(preset, str(tmp_path / preset))
        vocab = PRESETS[preset]["vocab_size"]
        write_dummy_tokenizer(model_dir, vocab)
    rng = random.Random(8)
    shared = [rng.randrange(3, vocab) for _ in range(200)]
    prompts = [([] if i % 3 else shared) + [rng.randrange(3, vocab) for _ in range(rng.randrange(5, 500))]
               for i in range(12)]
    params = [{"max_new_tokens": 4 + i, "temperature": 0, "ignore_eos": True} for i in range(12)]
    out = {}
    for graphs in (True, False):
        with _engine(model_dir, dtype=dtype, max_total_tokens=16384, max_running_requests=16,
                     chunked_prefill_size=512, max_prefill_tokens=1024, enable_prefill_cuda_graph=graphs) as eng:
            runner = eng.runner
            assert (runner.prefill_graph_runner is not None) == graphs
            out[graphs] = []
            for half in (prompts[:6], prompts[6:]):  # the second half hits the first's prefixes
                out[graphs] += eng.generate(input_ids=half, sampling_params=params[:len(half)],
                                            return_logprob=True, top_logprobs_num=2)
            if graphs:
                assert runner.prefill_graph_runner.buckets == [256, 512, 1024]
                assert runner.prefill_graph_runner.replays >= 3
                assert bool((runner.kv_pool.k_buffer[0][0] == 0).all()), "page 0 must stay zero"
            assert max(o["meta_info"]["cached_tokens"] for o in out[graphs]) >= 128
            eng.flush_cache()
            runner.allocator.debug_check()
    assert_greedy_close(out[True], out[False], 0.1 if dtype == "bfloat16" else ATOL, same_length=True)
