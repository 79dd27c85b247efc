"""Overlap scheduling (scheduler/overlap.py) is on for CUDA only; forced on here on CPU, it must
give exactly the plain scheduler's outputs and leave no KV slot behind, through EOS stops,
stop strings, length limits, mixed eligible / ineligible requests, aborts and a pool small
enough to force retraction. Real SmolLM2 weights (natural EOS), fp32, token and paged pools.
The CPU tests pin device="cpu" (deterministic fp32); the GPU test checks the CUDA-graph path."""
import pytest

from sgl_kvxfer.message import AbortReq, TokenizedGenerateReq
from sgl_kvxfer.sampling.params import SamplingParams

pytestmark = pytest.mark.slow

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
PROMPTS = [CHAT.format(q) for q in ("Say hi.", "Name a color.", "What is 2+2?", "Write a haiku about rain.",
                                     "List three fruits.", "Reply with one word: yes or no.")]
PROMPTS += ["def add(a, b):", "The capital of France is", "1, 2, 3, 4,"]


def _params(i):
    p = {"max_new_tokens": 6 + 7 * (i % 4), "temperature": 0}
    if i == 2:
        p["stop"] = ["4"]  # finishes on a stop string (host-side check)
    if i == 7:
        p["min_new_tokens"] = 3  # banned EOS for the first steps: not overlap-eligible then
    return p


def _run(engine, overlap: bool, params=None, prompts=PROMPTS):
    engine.scheduler.overlap = overlap
    params = params or [_params(i) for i in range(len(prompts))]
    res = engine.generate(prompts, params)  # one call: all requests run concurrently
    return [(r["output_ids"], r["meta_info"]["finish_reason"]) for r in res]


def _assert_no_leak(engine):
    assert engine.flush_cache()
    runner = engine.runner
    assert engine.scheduler.inflight is None
    assert runner.allocator.available_size() == runner.max_total_tokens
    getattr(runner.allocator, "debug_check", lambda: None)()


@pytest.mark.parametrize("page_size", [1, 16])
def test_overlap_matches_plain_and_frees_every_slot(smollm2_path, page_size):
    from sgl_kvxfer import Engine

    with Engine(smollm2_path, device="cpu", max_total_tokens=6000, page_size=page_size) as engine:
        plain = _run(engine, overlap=False)
        _assert_no_leak(engine)
        launched = []
        real = engine.scheduler._launch_followup
        engine.scheduler._launch_followup = lambda prev: launched.append(real(prev)) or launched[-1]
        overlapped = _run(engine, overlap=True)
        assert overlapped == plain
        assert sum(x is not None for x in launched) > 10  # the overlapped path really ran
        assert any(fr["type"] == "stop" for _, fr in plain)  # EOS / stop string: void tokens happened
        _assert_no_leak(engine)


def test_overlap_with_abort_and_retraction(smollm2_path, monkeypatch):
    """A pool too small for the batch (decode reserve off: decode retracts) and an abort that
    lands while a step is in flight: every other request still gets the plain outputs."""
    import sgl_kvxfer.scheduler.batch_formation as sched_mod
    from sgl_kvxfer import Engine

    prompts = [f"Item {i}: the history of the number {i * 37} in mathematics is" for i in range(12)]
    params = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    with Engine(smollm2_path, device="cpu", max_total_tokens=6000) as big:
        expected = {f"r{i}": out["output_ids"] for i, out in enumerate(big.generate(prompts, params))}
    monkeypatch.setattr(sched_mod, "decode_reserve", lambda *a, **k: 0)
    with Engine(smollm2_path, device="cpu", max_total_tokens=400, max_running_requests=12) as engine:
        sched = engine.scheduler
        sched.overlap = True
        sp = SamplingParams.from_dict(params)
        for i, prompt in enumerate(prompts):
            sched.handle(TokenizedGenerateReq(rid=f"r{i}", input_ids=engine.tokenizer.encode(prompt), sampling=sp))
        steps = 0
        while sched.has_work():
            sched.step()
            steps += 1
            if steps == 8:
                assert sched.inflight is not None
                sched.handle(AbortReq(rid="r1"))  # abort while a step is in flight
        outs = {}
        for o in sched.take_outputs():
            outs.setdefault(o.rid, []).append(o)
        assert outs["r1"][-1].finish_reason["type"] == "abort"
        assert sum(o[-1].num_retractions for o in outs.values()) > 0
        for rid, ids in expected.items():
            if rid != "r1":
                got = [t for o in outs[rid] for t in o.new_output_ids]
                assert got == ids, rid
        _assert_no_leak(engine)


@pytest.mark.heavy  # over 10 s on 2 cores: CI leaves it out (README, Tests)
@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_overlap_across_batches_and_chunks(smollm2_path, page_size):
    """Small prefill batches and chunks: many prefills are launched before the previous one is
    applied (chunk continuations, shared prefixes, ineligible requests in between). Outputs
    must equal the plain scheduler's and every slot must come back; an abort that lands while
    a prefill is pending finishes that request alone."""
    from sgl_kvxfer import Engine

    shared = "The history of mathematics is long and full of surprising turns. " * 3
    prompts = PROMPTS + [shared + "Tell me about Euclid.", shared + "Tell me about Gauss."]
    params = [_params(i) for i in range(len(prompts))]
    params[3] = {**params[3], "min_new_tokens": 2}  # banned EOS at its first token: no prefill overlap
    with Engine(smollm2_path, device="cpu", max_total_tokens=6000, page_size=page_size,
                max_prefill_tokens=48, chunked_prefill_size=32) as engine:
        plain = _run(engine, overlap=False, params=params, prompts=prompts)
        _assert_no_leak(engine)
        pending_seen = []
        real = engine.scheduler._apply_prefill
        engine.scheduler._apply_prefill = lambda: (pending_seen.append(engine.scheduler.pending_prefill is not None),
                                                   real())[1]
        assert _run(engine, overlap=True, params=params, prompts=prompts) == plain
        assert sum(pending_seen) >= 3  # prefills really were applied late (3 of its 5 batches qualify)
        _assert_no_leak(engine)

        sched = engine.scheduler
        sp = SamplingParams.from_dict({"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
        for i, prompt in enumerate(prompts[:6]):
            sched.handle(TokenizedGenerateReq(rid=f"a{i}", input_ids=engine.tokenizer.encode(prompt), sampling=sp))
        while sched.pending_prefill is None:
            sched.step()
        victim = next(s.req.rid for s in sched.pending_prefill.batch.slices if s.sample)
        sched.handle(AbortReq(rid=victim))
        while sched.has_work():
            sched.step()
        finals = {o.rid: o for o in sched.take_outputs() if o.finish_reason is not None}
        assert finals[victim].finish_reason["type"] == "abort"
        assert all(o.finish_reason["type"] == "length" for rid, o in finals.items() if rid != victim)
        _assert_no_leak(engine)


def test_applying_a_pending_prefill_counts_as_work(smollm2_path):
    """A step that only applies a pending prefill (its request then has no decode step: finished
    by its first token here, waiting for its KV to leave on a PD prefill server) reports work, so
    the event loop goes round at once instead of sleeping on its sockets before the next poll."""
    from sgl_kvxfer import Engine

    sp = SamplingParams.from_dict({"max_new_tokens": 1, "temperature": 0, "ignore_eos": True})
    with Engine(smollm2_path, device="cpu", max_total_tokens=2000) as engine:
        sched = engine.scheduler
        sched.overlap = True
        sched.handle(TokenizedGenerateReq(rid="p", input_ids=engine.tokenizer.encode(PROMPTS[0]), sampling=sp))
        while sched.pending_prefill is None:
            assert sched.step()
        assert sched.step() is True and sched.pending_prefill is None  # applied: the request is done
        assert [o.finish_reason["type"] for o in sched.take_outputs() if o.finish_reason] == ["length"]
        assert sched.step() is False  # now idle
        _assert_no_leak(engine)


@pytest.mark.gpu
def test_overlap_on_cuda_graphs(smollm2_path):
    """CUDA, bf16, CUDA graphs: with fixed lengths both modes run the same batch shapes, so the
    overlapped run must reproduce the plain one token for token; with natural EOS (void tokens)
    every slot must still come back."""
    from sgl_kvxfer import Engine

    with Engine(smollm2_path, device="cuda", dtype="bfloat16", max_total_tokens=20000) as engine:
        assert engine.scheduler.overlap and engine.runner.graph_runner is not None
        fixed = [{"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}] * len(PROMPTS)
        assert _run(engine, True, fixed) == _run(engine, False, fixed)
        _assert_no_leak(engine)
        _run(engine, True)
        _assert_no_leak(engine)


@pytest.mark.gpu
def test_inflight_tokens_do_not_wait_for_the_next_step():
    """Reading step N's tokens must not wait for work enqueued after N (step N + 1): with a
    plain .tolist() the copy queues behind it and the host serializes with the GPU."""
    import time

    import torch

    from sgl_kvxfer.scheduler.batch import ScheduleBatch
    from sgl_kvxfer.scheduler.overlap import InflightBatch

    logits = torch.randn(8, 100, device="cuda")
    expected = logits.argmax(-1).tolist()
    torch.cuda.synchronize()
    inf = InflightBatch.launch(ScheduleBatch(None), logits, torch.zeros(8, dtype=torch.int64, device="cuda"))
    torch.cuda._sleep(2_000_000_000)  # "step N + 1": about a second of GPU time behind the copy
    t = time.perf_counter()
    assert inf.token_list() == expected
    waited = time.perf_counter() - t
    torch.cuda.synchronize()
    assert waited < 0.2, f"token_list waited {waited:.3f} s for later work"
