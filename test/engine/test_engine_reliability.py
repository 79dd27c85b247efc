"""The offline Engine under hostile input and internal faults, on a tiny dummy-weights Llama (CPU):

- every hostile sampling value of hostile_requests.py is a ValueError naming the field, before
  any request of the call runs (the server's rules and messages: tokenizer/validation.py);
- a batch whose forward raises ends its own requests with a 500 abort and frees their KV; the
  engine serves the next request (Scheduler._recover);
- Engine.shutdown gives its memory back: engines created and shut down in a loop (kept alive
  by the caller) grow neither RSS nor the thread count.
"""
import gc
import json
import os
import sys
import threading

import psutil
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "server"))
from hostile_requests import SAMPLING_FIELDS, NOT_FINITE, GEN  # noqa: E402

VOCAB = 256
TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "vocab_size": VOCAB,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "max_position_embeddings": 512, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "float32",
}
POISON = 7  # a prompt holding this id makes the patched forward raise


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from sgl_kvxfer.models.presets import write_dummy_tokenizer

    d = tmp_path_factory.mktemp("tiny_llama")
    (d / "config.json").write_text(json.dumps(TINY))
    return write_dummy_tokenizer(str(d), VOCAB)


def make_engine(model_dir, **kw):
    from sgl_kvxfer import Engine

    return Engine(model_dir, load_format="dummy", device="cpu", max_total_tokens=kw.pop("max_total_tokens", 4096),
                  chunked_prefill_size=64, **kw)


@pytest.fixture(scope="module")
def engine(tiny_dir):
    with make_engine(tiny_dir) as eng:
        yield eng


def _python(value):
    """A hostile JSON value as a Python caller passes it (NaN / inf as floats)."""
    if isinstance(value, str) and value in NOT_FINITE:
        return float("nan") if "NaN" in value else float("-inf") if value.startswith("__-") else float("inf")
    if isinstance(value, dict):
        return {k: _python(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_python(v) for v in value]
    return value


def _bad_sampling():
    for field, (routes, values) in SAMPLING_FIELDS.items():
        if GEN in routes:
            for value in values:
                yield pytest.param(field, _python(value), id=f"{field}={str(value)[:24]}")


@pytest.mark.parametrize("field,value", list(_bad_sampling()))
def test_hostile_sampling_is_a_value_error(engine, field, value):
    params = {"max_new_tokens": 2, "temperature": 0, field: value}
    if field == "stop_token_ids":
        params["min_new_tokens"] = 1
    with pytest.raises(ValueError) as exc:
        engine.generate(input_ids=[5, 6, 8], sampling_params=params)
    assert str(exc.value)


@pytest.mark.parametrize("kwargs", [
    {"input_ids": [5, VOCAB]}, {"input_ids": [-1, 5]}, {"input_ids": [2**70]}, {"input_ids": []},
    {"input_ids": [[5], [True]]}, {"input_ids": [5], "prompt": "t5"}, {"prompt": "t5 \ud800"},
    {"input_ids": [5, 6], "return_logprob": True, "top_logprobs_num": 10**6},
    {"input_ids": [5, 6], "return_logprob": True, "token_ids_logprob": [VOCAB]},
    {"input_ids": [5, 6], "return_logprob": True, "logprob_start_len": 2},
    {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 10**9}},
], ids=lambda kw: ",".join(f"{k}={str(v)[:16]}" for k, v in kw.items()))
def test_hostile_arguments_are_a_value_error(engine, kwargs):
    with pytest.raises(ValueError):
        engine.generate(**kwargs)


def _kv_in_use(eng) -> int:
    eng.flush_cache()
    st = eng.scheduler.internal_state()
    return st.kv_used_tokens


def test_a_failing_batch_ends_its_requests_and_frees_their_kv(engine, monkeypatch):
    runner = engine.runner
    real_forward = runner.forward
    calls = {"decode": 0}

    def forward(fb):
        ids = fb.input_ids.tolist()
        if POISON in ids:
            raise RuntimeError("injected fault")
        if fb.mode.name == "DECODE" and 9 in ids:  # a decode step of a request that produced 9
            calls["decode"] += 1
            raise RuntimeError("injected decode fault")
        return real_forward(fb)

    monkeypatch.setattr(runner, "forward", forward)
    greedy = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    out = engine.generate(input_ids=[5, POISON, 8], sampling_params=greedy)
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 500 and "injected fault" in reason["message"]
    assert _kv_in_use(engine) == 0
    # a decode-time fault: force the first sampled token to be 9 (logit bias), then decode fails
    out = engine.generate(input_ids=[5, 6], sampling_params={**greedy, "logit_bias": {"9": 100}})
    assert out["meta_info"]["finish_reason"]["status_code"] == 500 and calls["decode"] == 1
    assert out["output_ids"][:1] == [9]
    assert _kv_in_use(engine) == 0
    # the engine goes on: a clean request is served in full
    monkeypatch.setattr(runner, "forward", real_forward)
    ok = engine.generate(input_ids=[5, 6, 8], sampling_params=greedy)
    assert ok["meta_info"]["finish_reason"]["type"] == "length" and len(ok["output_ids"]) == 4
    assert _kv_in_use(engine) == 0


POOL_TOKENS = 262144  # 256 MiB of KV per engine


def test_shutdown_returns_memory_and_threads(tiny_dir):
    """Engines kept referenced after shutdown (as `with Engine(...) as e:` leaves `e`) must not
    hold their pool: 6 engines of 256 MiB of KV each would grow RSS by 1.5 GiB if they did. The
    bound, half a pool, sits far from that and above the process's own drift (67 MiB over 6
    engines was seen on a 2-core CI machine, under a test worker that had run other modules)."""
    proc = psutil.Process()
    kept = []

    def cycle():
        eng = make_engine(tiny_dir, max_total_tokens=POOL_TOKENS)  # 2 layers x 2 x 2 x 32 x 4 B = 1 KiB/token
        for buf in eng.runner.kv_pool.k_buffer + eng.runner.kv_pool.v_buffer:
            buf.fill_(0.5)  # resident, as a pool in use is (the pool is allocated lazily)
        eng.generate(input_ids=[5, 6, 8], sampling_params={"max_new_tokens": 2})
        eng.shutdown()
        kept.append(eng)

    for _ in range(2):  # warm-up: imports, allocator arenas, tokenizer threads
        cycle()
    gc.collect()
    rss0, threads0 = proc.memory_info().rss, threading.active_count()
    native0 = proc.num_threads()
    for _ in range(6):
        cycle()
    gc.collect()
    grown = (proc.memory_info().rss - rss0) / 2**20
    assert grown < POOL_TOKENS / 1024 / 2, f"RSS grew by {grown:.0f} MiB over 6 engines"
    assert threading.active_count() <= threads0 and proc.num_threads() <= native0 + 2
    with pytest.raises(RuntimeError, match="shut down"):
        kept[-1].generate(input_ids=[5, 6])
    kept[-1].shutdown()  # idempotent
