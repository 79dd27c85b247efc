"""End-to-end HTTP tests against a real server on SmolLM2-135M (CPU): native /generate, OpenAI
routes through the official client, malformed requests, disconnect-abort, 64 concurrent
streams, metrics (the live_server fixture checks that its SIGTERM leaves no child behind)."""
import asyncio
import gzip
import json
import time

import aiohttp
import pytest
import requests
from servers import Deadline, scaled

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is"


def gen(url, body, **kw):
    return requests.post(url + "/generate", json=body, timeout=scaled(300), **kw)


def sse_events(resp):
    events = []
    for line in resp.iter_lines():
        if line.startswith(b"data: "):
            payload = line[len(b"data: "):]
            events.append(payload if payload == b"[DONE]" else json.loads(payload))
    return events


def test_generate_non_stream(live_server):
    r = gen(live_server.url, {"text": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}, "extra": 1})
    assert r.status_code == 200, r.text
    out = r.json()
    m = out["meta_info"]
    assert set(out) == {"text", "output_ids", "meta_info"} and isinstance(out["text"], str) and out["text"]
    assert m["completion_tokens"] == len(out["output_ids"]) <= 8 and m["prompt_tokens"] == 5
    for key in ("id", "finish_reason", "cached_tokens", "e2e_latency", "reasoning_tokens", "weight_version"):
        assert key in m
    assert m["finish_reason"]["type"] in ("length", "stop")


def test_generate_stream_is_cumulative(live_server):
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}, "stream": True}
    with gen(live_server.url, body, stream=True) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == b"[DONE]"
    chunks = events[:-1]
    for a, b in zip(chunks, chunks[1:]):
        assert b["text"].startswith(a["text"]) and b["output_ids"][:len(a["output_ids"])] == a["output_ids"]
        assert a["meta_info"]["finish_reason"] is None
    last = chunks[-1]["meta_info"]
    assert last["completion_tokens"] == 10 and last["finish_reason"] == {"type": "length", "length": 10}
    assert "e2e_latency" in last
    full = gen(live_server.url, {**body, "stream": False}).json()
    assert full["text"] == chunks[-1]["text"]


def test_batch_n_and_stream_index(live_server):
    r = gen(live_server.url, {"text": ["Hello", "One two three"], "sampling_params": {"max_new_tokens": 3, "n": 2}})
    outs = r.json()
    assert r.status_code == 200 and isinstance(outs, list) and len(outs) == 4
    assert outs[0]["meta_info"]["prompt_tokens"] == outs[1]["meta_info"]["prompt_tokens"] == 1
    assert outs[2]["meta_info"]["prompt_tokens"] == 3
    with gen(live_server.url, {"text": ["Hello", "Bye"], "sampling_params": {"max_new_tokens": 3}, "stream": True},
             stream=True) as r:
        events = sse_events(r)
    assert {e["index"] for e in events[:-1]} == {0, 1}


def test_logprobs_and_prefill_only(live_server):
    body = {"text": [PROMPT + " Paris", PROMPT + " London"], "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True, "return_text_in_logprobs": True, "logprob_start_len": 3}
    outs = gen(live_server.url, body).json()
    for out in outs:
        m = out["meta_info"]
        assert out["text"] == "" and out["output_ids"] == [] and m["completion_tokens"] == 0
        assert m["finish_reason"] == {"type": "length", "length": 0}
        lps = m["input_token_logprobs"]
        assert len(lps) == m["prompt_tokens"] - 3 and lps[0][0] is None
        assert all(isinstance(e[0], float) and isinstance(e[2], str) for e in lps[1:])
    paris, london = (sum(e[0] for e in o["meta_info"]["input_token_logprobs"][1:]) for o in outs)
    assert paris > london
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0}, "return_logprob": True,
            "top_logprobs_num": 3, "token_ids_logprob": [7042, 30]}
    m = gen(live_server.url, body).json()["meta_info"]
    assert m["input_token_logprobs"] == [] and len(m["output_token_logprobs"]) == m["output_token_logprobs_length"] == 4
    assert all(len(pos) == 3 for pos in m["output_top_logprobs"]) and "output_token_ids_logprobs" in m


def test_stop_string_is_trimmed(live_server):
    body = {"text": "Count: 1, 2, 3, 4,", "sampling_params": {"max_new_tokens": 20, "temperature": 0, "stop": [" 7"]}}
    out = gen(live_server.url, body).json()
    if out["meta_info"]["finish_reason"]["type"] == "stop":
        assert out["meta_info"]["finish_reason"]["matched"] == " 7" and " 7" not in out["text"]
    kept = gen(live_server.url, {**body, "sampling_params": {**body["sampling_params"], "no_stop_trim": True}}).json()
    if kept["meta_info"]["finish_reason"]["type"] == "stop":
        assert kept["text"].endswith(" 7")


def test_openai_client_chat_and_stream(live_server):
    import openai

    client = openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    resp = client.chat.completions.create(model="anything", messages=messages, max_tokens=12, temperature=0)
    assert resp.model == "anything" and resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content and resp.usage.completion_tokens <= 12
    assert resp.choices[0].finish_reason in ("stop", "length")
    stream = client.chat.completions.create(model="anything", messages=messages, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == resp.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == resp.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == resp.usage.completion_tokens
    comp = client.completions.create(model="m", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    assert comp.object == "text_completion" and len(comp.choices[0].logprobs.tokens) == comp.usage.completion_tokens
    models = client.models.list()
    assert models.data[0].id == "smollm2-135m" and models.data[0].owned_by == "sglang"  # not a cache path


def malformed_requests(url):
    long_prompt = "hello " * 3000
    cases = [
        ("/generate", b"{not json"), ("/generate", b""), ("/generate", b"[1, 2, 3]"), ("/generate", b'"text"'),
        ("/generate", b"null"), ("/generate", b"{}"), ("/generate", b'{"text": null}'),
        ("/v1/completions", b"{broken"), ("/v1/chat/completions", b"{broken"),
    ]
    bodies = [
        {"text": 123}, {"text": {"a": 1}}, {"text": [1, 2]}, {"input_ids": "abc"}, {"input_ids": []},
        {"input_ids": [[1, 2], "x"]}, {"input_ids": [-5]}, {"input_ids": [10 ** 9]},
        {"text": "hi", "sampling_params": {"max_new_tokens": -1}},
        {"text": "hi", "sampling_params": {"max_new_tokens": 10 ** 12}},
        {"text": "hi", "sampling_params": {"max_new_tokens": 10 ** 30}},
        {"text": "hi", "sampling_params": {"max_new_tokens": "ten"}},
        {"text": "hi", "sampling_params": {"max_new_tokens": 1.5}},
        {"text": "hi", "sampling_params": {"temperature": "hot"}}, {"text": "hi", "sampling_params": {"temperature": -1}},
        {"text": "hi", "sampling_params": {"top_p": 0}}, {"text": "hi", "sampling_params": {"top_p": 1.5}},
        {"text": "hi", "sampling_params": {"top_k": 0}}, {"text": "hi", "sampling_params": {"min_p": 2}},
        {"text": "hi", "sampling_params": {"frequency_penalty": 5}}, {"text": "hi", "sampling_params": {"repetition_penalty": 0}},
        {"text": "hi", "sampling_params": {"n": 0}}, {"text": "hi", "sampling_params": {"unknown_knob": 1}},
        {"text": "hi", "sampling_params": {"stop": 5}}, {"text": "hi", "sampling_params": {"stop_token_ids": ["a"]}},
        {"text": "hi", "sampling_params": {"min_new_tokens": 5, "max_new_tokens": 2}},
        {"text": "hi", "sampling_params": {"ignore_eos": "yes"}}, {"text": "hi", "sampling_params": "fast"},
        {"text": "hi", "sampling_params": {"logit_bias": {"999999999": 1.0}}},
        {"text": "hi", "sampling_params": {"regex": "[a-z]+"}},
        {"text": "hi", "stream": "yes"}, {"text": "hi", "return_logprob": "true"},
        {"text": "hi", "return_logprob": True, "logprob_start_len": 50},
        {"text": "hi", "top_logprobs_num": -3}, {"text": ["a", "b"], "rid": ["same", "same"]},
        {"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 1}]}, {"text": "hi", "rid": 7},
        {"text": long_prompt}, {"text": long_prompt, "stream": True},
    ]
    cases += [("/generate", json.dumps(b).encode()) for b in bodies]
    chat = [
        {"messages": "hello"}, {"messages": []}, {"messages": [{"content": "no role"}]},
        {"messages": [{"role": "wizard", "content": "hi"}]}, {"messages": [{"role": "user", "content": 5}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1},
        {"messages": [{"role": "user", "content": "hi"}], "temperature": "x"},
        {"messages": [{"role": "user", "content": "hi"}], "n": 0},
        {"messages": [{"role": "user", "content": long_prompt}]},
        {"model": "x"},
    ]
    cases += [("/v1/chat/completions", json.dumps(b).encode()) for b in chat]
    comp = [{"prompt": 5}, {"prompt": "hi", "max_tokens": 0}, {"prompt": "hi", "max_tokens": "a"}, {"prompt": []},
            {"prompt": "hi", "logprobs": 99}, {"prompt": long_prompt, "max_tokens": 4}, {}]
    cases += [("/v1/completions", json.dumps(b).encode()) for b in comp]
    return cases


def test_malformed_requests_get_4xx_then_valid_succeeds(live_server):
    cases = malformed_requests(live_server.url)
    assert len(cases) >= 50
    for path, data in cases:
        r = requests.post(live_server.url + path, data=data, headers={"Content-Type": "application/json"}, timeout=scaled(60))
        assert 400 <= r.status_code < 500, (path, data[:120], r.status_code, r.text[:200])
        body = r.json()
        assert "error" in body or body.get("object") == "error", (path, data[:120], body)
    r = requests.post(live_server.url + "/v1/completions", data=b'{"prompt": "hi"}', headers={"Content-Type": "text/plain"})
    assert r.status_code == 400
    ok = gen(live_server.url, {"text": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 2


def internal_state(url):
    return requests.get(url + "/get_server_info", timeout=scaled(30)).json()["internal_states"][0]


def test_requests_that_once_stopped_the_server_get_4xx_and_it_stays_up(live_server):
    """The hostile kinds that killed or hung a real server (NaN / inf logit bias, top_logprobs_num
    of a million, out-of-vocabulary logprob and stop ids with min tokens, n of 100,000, seeds and
    ids beyond 64 bits, lone surrogates, deep nesting, 5000-digit integers), streaming or not:
    each gets its 4xx, and the server still generates afterwards."""
    import sys

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from hostile_requests import cases

    crashers = [c for c in cases() if c.crasher]
    assert len(crashers) >= 60
    for c in crashers:
        r = requests.post(live_server.url + c.route, data=c.body, headers={"Content-Type": c.content_type}, timeout=120)
        assert r.status_code == c.expect and r.headers["content-type"].startswith("application/json"), (
            c.id, r.status_code, r.text[:200])
        assert requests.get(live_server.url + "/health", timeout=60).status_code == 200, c.id
    ok = gen(live_server.url, {"text": PROMPT, "sampling_params": {"max_new_tokens": 2, "logit_bias": {"5": -100}}})
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 2


def test_disconnect_aborts_and_frees_kv(live_server):
    body = {"text": "Tell me a very long story.", "stream": True,
            "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
    r = gen(live_server.url, body, stream=True)
    lines = r.iter_lines()
    got = 0
    for line in lines:
        if line.startswith(b"data: "):
            got += 1
            if got == 3:
                break
    assert internal_state(live_server.url)["num_running_reqs"] == 1
    r.close()
    deadline = Deadline(30)
    while not deadline.expired():
        st = internal_state(live_server.url)
        if st["num_running_reqs"] == 0 and st["num_queue_reqs"] == 0 and st["kv_used_tokens"] == st["kv_cached_tokens"]:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"request not aborted after disconnect: {st}")
    assert requests.post(live_server.url + "/flush_cache", timeout=scaled(30)).status_code == 200
    assert internal_state(live_server.url)["kv_used_tokens"] == 0


def test_64_concurrent_streams_match_non_stream(live_server):
    prompts = [f"Write item number {i} of a shopping list:" for i in range(64)]
    # 64 at once is the point (every stream in one running batch); a few tokens each cover
    # streaming and its agreement with the non-stream batch
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    reference = gen(live_server.url, {"text": prompts, "sampling_params": params}).json()

    async def one(session, prompt):
        last = None
        async with session.post(live_server.url + "/generate",
                                json={"text": prompt, "sampling_params": params, "stream": True}) as resp:
            assert resp.status == 200
            async for raw in resp.content:
                line = raw.strip()
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    last = json.loads(line[6:])
        return last

    async def run_all():
        timeout = aiohttp.ClientTimeout(total=scaled(600))
        async with aiohttp.ClientSession(timeout=timeout) as session:
            return await asyncio.gather(*(one(session, p) for p in prompts))

    streamed = asyncio.run(run_all())
    assert all(s["meta_info"]["completion_tokens"] == 6 for s in streamed)
    mismatched = [i for i, (s, ref) in enumerate(zip(streamed, reference)) if s["text"] != ref["text"]]
    assert not mismatched, [(streamed[i]["text"], reference[i]["text"]) for i in mismatched[:3]]


def test_info_health_metrics_routes(live_server):
    url = live_server.url
    assert requests.get(url + "/health").status_code == 200 and requests.get(url + "/health").content == b""
    assert requests.get(url + "/health_generate").status_code == 200
    mi = requests.get(url + "/get_model_info").json()
    assert mi == requests.get(url + "/model_info").json() and mi["model_path"] and mi["is_generation"]
    si = requests.get(url + "/server_info").json()
    assert si["version"] == "0.5.23" and si["tp_size"] == 1 and si["status"] == "ready"
    assert si["chunked_prefill_size"] == 512  # LIVE_ARGS; unset, the scheduler reports its device's size
    st = si["internal_states"][0]
    for key in ("last_gen_throughput", "kv_bytes_per_token", "token_usage", "kv_used_tokens", "max_total_num_tokens"):
        assert key in st
    assert requests.get(url + "/get_load").json()[0]["dp_rank"] == 0
    assert requests.post(url + "/abort_request", json={"rid": "nope"}).status_code == 200
    metrics = requests.get(url + "/metrics").text
    for name in ("prompt_tokens_total", "generation_tokens_total", "num_requests_total", "gen_throughput",
                 "cache_hit_rate", "token_usage", "num_queue_reqs", "time_to_first_token_seconds_bucket"):
        assert f"sglang:{name}" in metrics, name
    gen_total = [line for line in metrics.splitlines() if line.startswith("sglang:generation_tokens_total")]
    assert float(gen_total[0].split()[-1]) > 0



def test_profile_captures_the_schedulers_forward_steps(live_server, tmp_path):
    """num_steps ends the capture at the scheduler step that ran its last counted forward: the
    trace is on disk by the time /generate (8 forward steps) answers."""
    r = requests.post(live_server.url + "/start_profile", timeout=scaled(30),
                      json={"output_dir": str(tmp_path), "num_steps": 2, "profile_id": "live"})
    assert r.status_code == 200 and r.text == "Start profiling.\n"
    r = gen(live_server.url, {"text": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    assert r.status_code == 200
    path = tmp_path / "live-TP-0.trace.json.gz"
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    assert any("aten::" in e.get("name", "") for e in events)  # the model's ops, recorded in the scheduler
    assert requests.post(live_server.url + "/stop_profile", timeout=scaled(30)).status_code == 400  # ended itself
