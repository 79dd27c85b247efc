"""CUDA-graph decode (engine/cuda_graph_runner.py): bucket math, the static-buffer path against the
eager forward, and (GPU) greedy outputs with graphs on vs --disable-cuda-graph.

On CPU the graph runner runs in "eager replay" mode (use_graphs=False): `replay` fills the static
buffers (padding included) and calls the capture target `decode_step_static` directly, so the
padding invariant and the fixed-width attention plan are checked without CUDA (Triton kernels
under TRITON_INTERPRET=1, set by test/conftest.py).
"""
import random

import pytest
import torch

from sgl_kvxfer.engine.cuda_graph_runner import (CudaGraphRunner, bucket_for, cuda_graph_buckets,
                                                 resolve_max_bs)
from sgl_kvxfer.forward_batch import ForwardMode

from greedy_checks import assert_greedy_close
from tiny_models import tiny_llama

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TINY = tiny_llama(vocab_size=512, hidden_size=64, intermediate_size=128, head_dim=16)
ATOL = 2e-2  # fp16 attention: the graph plan splits the context differently from the eager plan


def _engine(model_dir, **kw):
    from sgl_kvxfer import Engine

    args = dict(load_format="dummy", dtype="float16", device=DEVICE, attention_backend="triton", page_size=16,
                max_total_tokens=1024, max_running_requests=8, chunked_prefill_size=128)
    return Engine(model_dir, **{**args, **kw})


def _prompts(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, TINY["vocab_size"]) for _ in range(n)] for n in lengths]


def test_buckets_and_padding_math():
    assert cuda_graph_buckets(1) == [1]
    assert cuda_graph_buckets(5) == [1, 2, 4, 5]
    assert cuda_graph_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    big = cuda_graph_buckets(256)
    assert big[-3:] == [224, 240, 256] and 80 in big and 72 not in big
    assert cuda_graph_buckets(100) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100]
    assert [bucket_for(b, big) for b in (1, 3, 8, 9, 65, 256)] == [1, 4, 8, 16, 80, 256]
    with pytest.raises(AssertionError):
        bucket_for(257, big)
    assert resolve_max_bs(None, 300) == 256 and resolve_max_bs(None, 12) == 12
    assert resolve_max_bs(512, 300) == 300 and resolve_max_bs(4, 300) == 4


def test_flags():
    from sgl_kvxfer.config import EngineConfig
    from sgl_kvxfer.server.flags import parse_server_args

    args = parse_server_args(["--disable-cuda-graph", "--cuda-graph-max-bs", "8"])
    assert args.engine.disable_cuda_graph and args.engine.cuda_graph_max_bs == 8
    args = parse_server_args([])
    assert not args.engine.disable_cuda_graph and args.engine.cuda_graph_max_bs is None
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        EngineConfig(cuda_graph_max_bs=0)


def _kv(pool):
    return [b.clone() for b in pool.k_buffer + pool.v_buffer]


def _eager_then_static(pool, fb, eager_forward, replay):
    """Run `fb` eagerly, put the KV pool back as it was, then run it through `replay`.
    Returns (eager logits, static logits, KV after eager, KV after static)."""
    before = _kv(pool)
    ref = eager_forward(fb).clone()
    after_eager = _kv(pool)
    for buf, saved in zip(pool.k_buffer + pool.v_buffer, before):
        buf.copy_(saved)
    got = replay(fb).clone()
    return ref, got, after_eager, _kv(pool)


def _assert_kv_differs_only_in_new_slots(after_eager, after_static, fb, page_size, scratch_page):
    """Page 0 stays zero; the batch's new slots are close; every other slot (scratch page aside)
    is bitwise equal (never-written pages are torch.empty garbage, NaN included)."""
    new_pages, new_offs = fb.out_cache_loc // page_size, fb.out_cache_loc % page_size
    for e, s in zip(after_eager, after_static):
        assert bool((s[0] == 0).all()), "page 0 must stay zero"
        assert torch.allclose(s[new_pages, :, new_offs].float(), e[new_pages, :, new_offs].float(), atol=ATOL)
        s[new_pages, :, new_offs] = e[new_pages, :, new_offs]
        s[scratch_page], e[scratch_page] = 0, 0
        assert torch.equal(s.view(torch.int16), e.view(torch.int16)), \
            "the static path wrote KV outside the batch's new slots"


@pytest.mark.heavy  # over 10 s on 2 cores: CI leaves it out (README, Tests)
def test_static_decode_matches_eager(tiny_dir):
    """Every decode step runs twice from the same KV state: the eager forward, then the graph
    runner's static path. Decode batch sizes 4, 3, 2, 2, 1 (bucket 4 without and with a padding
    row over a row the previous step left live, then buckets 2 and 1). Logits agree; the KV pool
    after both is bitwise equal except the new tokens' slots (close) and the scratch page; page 0
    stays zero."""
    with _engine(tiny_dir, disable_cuda_graph=True) as eng:  # the eager reference stays eager on GPU
        runner = eng.runner
        assert runner.graph_runner is None
        static = CudaGraphRunner(runner, max_bs=4, use_graphs=False)
        assert static.buckets == [1, 2, 4] and static.max_seq_len == 1024
        pool, P = runner.kv_pool, runner.page_size
        scratch_page = pool.scratch_slot // P
        eager_forward, seen = runner.forward, []

        def forward(fb):
            if fb.mode != ForwardMode.DECODE:
                return eager_forward(fb)
            assert static.can_run(fb)
            assert torch.equal(fb.logits_positions.cpu(), torch.arange(fb.batch_size))
            ref, got, after_eager, after_static = _eager_then_static(pool, fb, eager_forward, static.replay)
            B, bs = fb.batch_size, bucket_for(fb.batch_size, static.buckets)
            assert bool((static.out_cache_loc[B:bs] == pool.scratch_slot).all())  # padding rows,
            assert bool((static.seq_lens[B:bs] == 0).all())  # also where an earlier batch was live
            assert bool((static.req_pool_indices[B:bs] == runner.padding_req_row).all())
            assert got.shape == ref.shape
            # dummy-weight logits are ~0.5: 5e-3 is ~20 fp16 ulps (seen: 5e-4)
            assert (got - ref).abs().max() < 5e-3, (B, (got - ref).abs().max())
            _assert_kv_differs_only_in_new_slots(after_eager, after_static, fb, P, scratch_page)
            seen.append(fb.batch_size)
            return got

        runner.forward = forward  # the scheduler calls runner.forward
        prompts = _prompts([20, 5, 33, 16], seed=4)  # 16: decode starts on a fresh page
        params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in (2, 3, 5, 6)]
        out = eng.generate(input_ids=prompts, sampling_params=params)
        assert [len(o["output_ids"]) for o in out] == [2, 3, 5, 6]
        assert seen == [4, 3, 2, 2, 1], seen
        assert static.replays == len(seen)
        # A batch past max_bs is not the graph runner's: ModelRunner.forward takes the eager path.
        runner.forward = eager_forward
        runner.graph_runner = static
        five = eng.generate(input_ids=_prompts([7] * 5, seed=5),
                            sampling_params={"max_new_tokens": 3, "temperature": 0, "ignore_eos": True})
        assert all(len(o["output_ids"]) == 3 for o in five)
        # decode sizes 5 (eager) then 5 (eager): no replay; a later batch of 2 replays
        assert static.replays == len(seen)
        eng.generate(input_ids=_prompts([9, 9], seed=6),
                     sampling_params={"max_new_tokens": 2, "temperature": 0, "ignore_eos": True})
        assert static.replays == len(seen) + 1
        eng.flush_cache()
        runner.allocator.debug_check()
        assert runner.allocator.available_size() == runner.max_total_tokens


def test_graph_runner_not_used_off_cuda_or_on_torch_backend(tiny_dir):
    from sgl_kvxfer.engine.cuda_graph_runner import graph_unsupported_reason

    with _engine(tiny_dir, attention_backend="torch", page_size=1) as eng:
        assert eng.runner.graph_runner is None
        reason = graph_unsupported_reason(eng.runner)
        assert reason is not None and ("not CUDA" in reason or "graph-safe" in reason)
    with _engine(tiny_dir, disable_cuda_graph=True) as eng:
        assert eng.runner.graph_runner is None
        assert graph_unsupported_reason(eng.runner) == "disabled by --disable-cuda-graph"



@pytest.mark.gpu
@pytest.mark.parametrize("preset,dtype", [(None, "float16"), ("smollm2-135m", "bfloat16")])
def test_gpu_graphs_match_eager(tmp_path, tiny_dir, preset, dtype):
    """Graphs on vs --disable-cuda-graph: 12 requests with staggered lengths, so decode batches
    shrink 12 -> 1 through padded buckets; cuda_graph_max_bs 8 sends the first steps eager."""
    from sgl_kvxfer.models.presets import PRESETS, write_dummy_tokenizer, write_preset_config

    model_dir, vocab = tiny_dir, TINY["vocab_size"]
    if preset is not None:
        model_dir = write_preset_config(preset, str(tmp_path / preset))
        vocab = PRESETS[preset]["vocab_size"]
        write_dummy_tokenizer(model_dir, vocab)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(5, 300))] for _ in range(12)]
    params = [{"max_new_tokens": 4 + 3 * i, "temperature": 0, "ignore_eos": True} for i in range(12)]
    out = {}
    for graphs in (True, False):
        with _engine(model_dir, dtype=dtype, max_total_tokens=16384, max_running_requests=16,
                     chunked_prefill_size=512, cuda_graph_max_bs=8, disable_cuda_graph=not graphs) as eng:
            runner = eng.runner
            assert (runner.graph_runner is not None) == graphs
            out[graphs] = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True,
                                       top_logprobs_num=2)
            if graphs:
                assert runner.graph_runner.buckets == [1, 2, 4, 8]
                assert runner.graph_runner.replays > 20
                assert bool((runner.kv_pool.k_buffer[0][0] == 0).all()), "page 0 must stay zero"
            eng.flush_cache()
            runner.allocator.debug_check()
    assert_greedy_close(out[True], out[False], 0.1 if dtype == "bfloat16" else ATOL, same_length=True)
