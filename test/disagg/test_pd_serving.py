"""PD disaggregation end to end on CPU with SmolLM2: real prefill / decode server processes,
Mooncake's transfer engine over loopback TCP, and the real `sglang_router` 0.3.2 in front.

One prefill P (with faults armed for a few rooms), one decode D and one single server S share
the module; greedy outputs through the router are token-identical to S's. Fault rooms are sent
to P and D directly with the router's body, as the router would. Every fault ends in a correct
answer from D (its local prefill), a fallback counted in /metrics, and no KV left behind.
"""
from __future__ import annotations

import concurrent.futures as cf
import functools
import gzip
import json
import re
import subprocess
import sys
import threading
import time

import pytest
import requests

from servers import ROOT, Deadline, free_port, scaled, start_all, start_router, start_server, stop_all

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    __import__("importlib").util.find_spec("sglang_router") is None, reason="sglang-router is not installed")]

COMMON = ["--max-total-tokens", "8192", "--chunked-prefill-size", "128", "--max-running-requests", "16",
          "--context-length", "2048", "--log-level", "warning", "--enable-metrics", "--kv-transfer-buffer-mb", "64"]
ROOM_CORRUPT, ROOM_TRUNCATE, ROOM_DELAY, ROOM_ORPHAN = 9001, 9002, 9003, 9004


@functools.lru_cache(maxsize=1)
def transfer_timeout() -> int:
    """--kv-transfer-timeout of the module's servers: 6 s of an idle machine, stretched by the
    load when the module starts (a busy machine must not turn a slow transfer into a fault)."""
    return round(scaled(6))


def faults() -> str:
    """Faults armed on the module's prefill; the delayed room stalls well past the timeout."""
    return f"corrupt@{ROOM_CORRUPT},truncate@{ROOM_TRUNCATE},delay:{2 * transfer_timeout()}@{ROOM_DELAY}"
PROMPTS = [
    "The history of the Python programming language begins in the late 1980s, when Guido van Rossum " * 4,
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Write a short poem about the sea.",
]


def greedy(prompt, max_new=12, **extra):
    return {"text": prompt, "sampling_params": {"max_new_tokens": max_new, "temperature": 0}, **extra}


def pd_args(mode: str, bootstrap_port: int | None = None, *extra) -> list[str]:
    # the claim deadline as long as the (load-scaled) transfer timeout: a decode slowed by the
    # shared machine registers late without turning a transfer into a fallback
    args = [*COMMON, "--disaggregation-mode", mode, "--kv-transfer-timeout", str(transfer_timeout()),
            "--kv-claim-timeout", str(transfer_timeout()), *extra]
    if bootstrap_port is not None:
        args += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
    return args


@pytest.fixture(scope="module")
def cluster():
    bp = free_port()
    p, d, s = start_all([(pd_args("prefill", bp), {"SGL_KVXFER_KV_TRANSFER_FAULT": faults()}, "pd_prefill"),
                         (pd_args("decode"), None, "pd_decode"), (COMMON, None, "pd_single")])
    try:
        router = start_router([(p.url, bp)], [d.url])
    except Exception:
        stop_all(p, d, s)
        raise
    yield {"P": p, "D": d, "S": s, "router": router, "bp": bp}
    stop_all(router, p, d, s)


# NOTE: every wait below is in seconds of an idle machine, stretched by the load (servers.scaled,
# servers.Deadline): these servers share 2 cores with whatever else runs.
def post(url, body, timeout=120):
    r = requests.post(url + "/generate", json=body, timeout=scaled(timeout))
    assert r.status_code == 200, r.text
    return r.json()


def pd_direct(cluster, body, room, prefill=None):
    """What the router does: the same body to P and D at once, D's reply to the client."""
    body = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": cluster["bp"], "bootstrap_room": room}
    with cf.ThreadPoolExecutor(2) as pool:
        fp = pool.submit(requests.post, (prefill or cluster["P"]).url + "/generate", json=body, timeout=scaled(120))
        fd = pool.submit(requests.post, cluster["D"].url + "/generate", json=body, timeout=scaled(120))
        return fp.result(), fd.result()


def server_info(handle):
    return requests.get(handle.url + "/server_info", timeout=scaled(30)).json()


def kv_state(handle):
    st = server_info(handle)["internal_states"][0]
    return st["kv_used_tokens"] - st["kv_cached_tokens"], st.get("kv_transfer", {})


def assert_nothing_leaked(*handles):
    """Once idle, a server's KV slots are all free or cached (flushing frees the cache), and its
    transfer buffer and rooms are empty."""
    for h in handles:
        deadline = Deadline(30)
        while True:
            flushed = requests.post(h.url + "/flush_cache", timeout=scaled(30)).status_code == 200
            st = server_info(h)["internal_states"][0]
            kv = st.get("kv_transfer", {})
            if flushed and st["kv_used_tokens"] == 0 and not kv.get("rooms_open") and not kv.get(
                    "send_buffer_used_bytes") and not kv.get("staging_used_bytes"):
                break
            assert not deadline.expired(), (h.url, st, str(deadline))
            time.sleep(0.5)


def metric(handle, name) -> float:
    text = requests.get(handle.url + "/metrics", timeout=scaled(30)).text
    m = re.search(rf"^sglang:{name}\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


# ---------------------------------------------------------------- through the real router
def test_router_generate_is_token_identical_to_a_single_server(cluster):
    for prompt in PROMPTS:
        ours = post(cluster["router"].url, greedy(prompt))
        ref = post(cluster["S"].url, greedy(prompt))
        assert ours["output_ids"] == ref["output_ids"], prompt
        assert ours["text"] == ref["text"]
        meta = ours["meta_info"]
        assert meta["kv_transfer"]["status"] == "ok" and meta["prompt_tokens"] == ref["meta_info"]["prompt_tokens"]
        # bytes on the wire per token: the model dtype's full KV (fp32 on CPU: 2 x 30 x 3 x 64 x 4)
        assert meta["kv_transfer"]["bytes_per_token"] == 2 * 30 * 3 * 64 * 4


def test_profile_of_the_prefill_server_while_a_request_goes_through(cluster, tmp_path):
    """/start_profile on the prefill server records its scheduler's steps (the prompt's forward
    and the KV hand-off around it) until /stop_profile writes the trace."""
    p = cluster["P"].url
    body = {"output_dir": str(tmp_path), "profile_id": "pd", "activities": ["CPU"]}
    r = requests.post(p + "/start_profile", json=body, timeout=scaled(30))
    assert r.status_code == 200, r.text
    assert post(cluster["router"].url, greedy(PROMPTS[1]))["meta_info"]["kv_transfer"]["status"] == "ok"
    assert requests.post(p + "/stop_profile", timeout=scaled(120)).status_code == 200
    with gzip.open(tmp_path / "pd-TP-0.trace.json.gz") as f:
        assert any("aten::" in e.get("name", "") for e in json.load(f)["traceEvents"])


def test_a_prompt_whose_head_the_prefill_cached_arrives_whole(cluster):
    """The prefill serves a long prompt's head from its prefix cache and computes the rest in
    chunks: the decode still gets every position's KV (the cached head too), so the reply
    is the single server's and the bytes are the full prompt's."""
    post(cluster["router"].url, greedy(PROMPTS[0]))  # the head, now cached on P
    body = greedy(PROMPTS[0] * 3, max_new=16)  # ~300 tokens: chunks of 128 start past the head
    ours, ref = post(cluster["router"].url, body), post(cluster["S"].url, body)
    assert ours["meta_info"]["kv_transfer"]["status"] == "ok"
    assert ours["meta_info"]["kv_transfer"]["bytes_per_token"] == 2 * 30 * 3 * 64 * 4
    assert ours["output_ids"] == ref["output_ids"]


def test_router_streams_cumulative_text(cluster):
    r = requests.post(cluster["router"].url + "/generate", json=greedy(PROMPTS[0], stream=True), stream=True,
                      timeout=scaled(120))
    chunks = [line[6:] for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]"
    import json

    texts = [json.loads(c)["text"] for c in chunks[:-1]]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == post(cluster["S"].url, greedy(PROMPTS[0]))["text"]


def test_router_chat_completions(cluster):
    body = {"model": "x", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0}
    ours = requests.post(cluster["router"].url + "/v1/chat/completions", json=body, timeout=scaled(120)).json()
    ref = requests.post(cluster["S"].url + "/v1/chat/completions", json=body, timeout=scaled(120)).json()
    assert ours["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]


def test_router_merges_prefill_input_logprobs_with_decode_output_logprobs(cluster):
    body = greedy(PROMPTS[1], max_new=6, return_logprob=True, logprob_start_len=0)
    ours, ref = post(cluster["router"].url, body), post(cluster["S"].url, body)
    mo, mr = ours["meta_info"], ref["meta_info"]
    assert [e[1] for e in mo["input_token_logprobs"]] == [e[1] for e in mr["input_token_logprobs"]]
    assert mo["input_token_logprobs"][0][0] is None  # SGLang's shifted first entry, from P
    assert [e[1] for e in mo["output_token_logprobs"]] == ours["output_ids"] == ref["output_ids"]
    for a, b in zip(mo["output_token_logprobs"] + mo["input_token_logprobs"][1:],
                    mr["output_token_logprobs"] + mr["input_token_logprobs"][1:]):
        assert abs(a[0] - b[0]) < 1e-4


def test_bench_serving_through_the_router(cluster, tmp_path):
    sys.path.insert(0, f"{ROOT}/benchmarks")
    from common.sglang_clients import bench_serving_command, bench_serving_env

    model = server_info(cluster["P"])["model_path"]
    cmd = bench_serving_command(
        "--backend", "sglang", "--base-url", cluster["router"].url, "--tokenizer", model, "--model", model,
        "--dataset-name", "random-ids", "--random-input-len", "48", "--random-output-len", "6",
        "--random-range-ratio", "1.0", "--num-prompts", "12", "--request-rate", "inf", "--max-concurrency", "4",
        "--disable-tqdm")
    proc = subprocess.run(cmd, cwd=str(tmp_path), env=bench_serving_env(), capture_output=True, text=True,
                          timeout=scaled(900))
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, report[-3000:]
    assert re.search(r"Successful requests:\s+12\b", report), report[-3000:]


# ---------------------------------------------------------------- SGLang's PD rules (section 4.6)
def test_info_routes_report_the_role(cluster):
    for name, mode in (("P", "prefill"), ("D", "decode"), ("S", "null")):
        assert requests.get(cluster[name].url + "/get_model_info").json()["disaggregation_mode"] == mode
        assert server_info(cluster[name])["disaggregation_mode"] == mode


def test_missing_room_is_a_400_and_no_peer_computes_locally(cluster):
    r = requests.post(cluster["D"].url + "/generate", json=greedy(PROMPTS[2]), timeout=scaled(60))
    assert r.status_code == 400 and "bootstrap room" in r.text
    local = post(cluster["D"].url, greedy(PROMPTS[2], bootstrap_host="2.2.2.2", bootstrap_room=1))
    assert local["output_ids"] == post(cluster["S"].url, greedy(PROMPTS[2]))["output_ids"]
    prefill_only = post(cluster["P"].url, greedy(PROMPTS[2], bootstrap_host="2.2.2.2", bootstrap_room=2))
    assert prefill_only["meta_info"]["completion_tokens"] == 1  # a prefill server never decodes


def test_decode_may_arrive_before_the_prefill(cluster):
    body = {**greedy(PROMPTS[2]), "bootstrap_host": "127.0.0.1", "bootstrap_port": cluster["bp"], "bootstrap_room": 8101}
    with cf.ThreadPoolExecutor(1) as pool:
        decode = pool.submit(requests.post, cluster["D"].url + "/generate", json=body, timeout=scaled(120))
        time.sleep(1.5)  # D claims a room P has not seen yet
        assert post(cluster["P"].url, body)["meta_info"]["kv_transfer"]["status"] == "ok"
        out = decode.result().json()
    assert out["meta_info"]["kv_transfer"]["status"] == "ok"
    assert out["output_ids"] == post(cluster["S"].url, greedy(PROMPTS[2]))["output_ids"]


# ---------------------------------------------------------------- faults: the answer is still right
@pytest.mark.parametrize("room,reason", [(ROOM_CORRUPT, "checksum"), (ROOM_TRUNCATE, "checksum"),
                                         (ROOM_DELAY, "timeout")])
def test_faulty_transfer_falls_back_to_a_local_prefill(cluster, room, reason):
    before = metric(cluster["D"], "kv_transfer_fallbacks_total")
    p, d = pd_direct(cluster, greedy(PROMPTS[0]), room)
    assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
    out = d.json()
    assert out["meta_info"]["kv_transfer"]["status"].startswith("fallback: " + reason)
    assert out["output_ids"] == post(cluster["S"].url, greedy(PROMPTS[0]))["output_ids"]
    assert metric(cluster["D"], "kv_transfer_fallbacks_total") == before + 1
    assert_nothing_leaked(cluster["P"], cluster["D"])


def test_a_room_no_decode_registers_for_is_dropped(cluster):
    body = {**greedy(PROMPTS[2]), "bootstrap_host": "127.0.0.1", "bootstrap_port": cluster["bp"],
            "bootstrap_room": ROOM_ORPHAN}
    start = time.time()
    out = post(cluster["P"].url, body)  # no decode: the reply ends at the claim deadline, 2xx
    assert time.time() - start >= transfer_timeout() - 1  # the module's --kv-claim-timeout
    assert out["meta_info"]["kv_transfer"]["status"].startswith(
        "failed: decode unreachable: no decode registered for the room")
    assert_nothing_leaked(cluster["P"])


def test_prefill_killed_mid_transfer(cluster):
    bp = free_port()
    p2 = start_server(pd_args("prefill", bp), env={"SGL_KVXFER_KV_TRANSFER_FAULT": "delay:4"}, name="pd_prefill_doomed")
    try:
        body = {**greedy(PROMPTS[0]), "bootstrap_host": "127.0.0.1", "bootstrap_port": bp, "bootstrap_room": 8201}
        with cf.ThreadPoolExecutor(2) as pool:
            pool.submit(requests.post, p2.url + "/generate", json=body, timeout=scaled(60))
            decode = pool.submit(requests.post, cluster["D"].url + "/generate", json=body, timeout=scaled(120))
            deadline = Deadline(60)
            while server_info(p2)["internal_states"][0]["kv_transfer"]["rooms_open"] == 0:
                assert not deadline.expired(), str(deadline)
                time.sleep(0.2)  # the room is open: P2's sender sleeps before its first write
            p2.proc.kill()
            out = decode.result().json()
    finally:
        p2.stop()
    assert out["meta_info"]["kv_transfer"]["status"].startswith("fallback")
    assert out["output_ids"] == post(cluster["S"].url, greedy(PROMPTS[0]))["output_ids"]
    assert_nothing_leaked(cluster["D"])


def test_pools_are_empty_after_the_module(cluster):
    assert_nothing_leaked(cluster["P"], cluster["D"])


# ---------------------------------------------------------------- SpectrumKV-tiered payload
@pytest.mark.heavy  # over 10 s on 2 cores: CI leaves it out (README, Tests)
def test_tiered_pd_matches_the_tiered_single_server():
    """b=0.5 on every server: the payload is the prefill's stored tier codes, the decode holds
    them bit for bit, so greedy outputs equal a tiered single server's, for both transfer
    streams. `end` sends each token's final tier once the prefill ends; `int8` sends 32-token
    chunks at int8 as they finish, then a replacing segment with every token whose final tier is
    not int8, so the decode ends up with the same codes. All servers prefill in the same 32-token
    chunks (same chunks: same importance). One decode server serves both prefills: the `end`
    one through the router, the `int8` one with the router's two posts sent directly."""
    tier = ["--kv-tier-budget", "0.5", "--kv-int4", "on", "--chunked-prefill-size", "32"]
    bp_end, bp_int8 = free_port(), free_port()
    p_end, p_int8, d, s = start_all([
        (pd_args("prefill", bp_end, *tier, "--kv-transfer-stream", "end"), None, "pd_prefill_b05_end"),
        (pd_args("prefill", bp_int8, *tier, "--kv-transfer-stream", "int8"), None, "pd_prefill_b05_int8"),
        (pd_args("decode", None, *tier), None, "pd_decode_b05"), (COMMON + tier, None, "single_b05")])
    router = None
    try:
        router = start_router([(p_end.url, bp_end)], [d.url])
        int8_pair = {"P": p_int8, "D": d, "bp": bp_int8}
        full = 2 * 30 * 3 * 64 * 4
        for room, prompt in enumerate(PROMPTS[:2], start=7000):
            ref = post(s.url, greedy(prompt, max_new=16))
            _, reply = pd_direct(int8_pair, greedy(prompt, max_new=16), room)  # the router's two posts
            assert reply.status_code == 200, reply.text
            for stream, ours in (("end", post(router.url, greedy(prompt, max_new=16))), ("int8", reply.json())):
                assert ours["output_ids"] == ref["output_ids"], (stream, prompt)
                ratio = ours["meta_info"]["kv_transfer"]["bytes_per_token"] / full
                # the budget's tiers on the wire (scales included), not fp32; the int8 stream
                # also sends the int8 copies that the end segment replaces
                assert 0.2 < ratio <= (0.5 if stream == "end" else 1.0), (stream, ratio)
        info = server_info(d)["internal_states"][0]
        assert info["kv_bytes_per_token"] < 0.6 * full  # the decode pool holds them tiered
        # the chunk streams (switched on the running prefill): each 32-token chunk leaves at tiers
        # of its own within the budget; the upgrade pass may add the tokens whose tier rose
        ratios = {}
        for room, stream in ((7100, "chunk"), (7101, "chunk-upgrade")):
            r = requests.post(p_int8.url + "/kv_transfer_link", json={"rate_gbps": 0, "stream": stream}, timeout=30)
            assert r.status_code == 200, r.text
            assert requests.post(p_int8.url + "/flush_cache", timeout=30).status_code == 200  # every chunk computed
            _, reply = pd_direct(int8_pair, greedy(PROMPTS[0], max_new=16), room)
            out = reply.json()
            kv = out["meta_info"]["kv_transfer"]
            assert reply.status_code == 200 and kv["status"] == "ok" and len(out["output_ids"]) == 16, (stream, kv)
            ratios[stream] = kv["bytes_per_token"] / full
        assert 0.2 < ratios["chunk"] <= 0.5 and ratios["chunk"] <= ratios["chunk-upgrade"] <= 1.0, ratios
        assert requests.post(p_int8.url + "/kv_transfer_link", json={"rate_gbps": 5}).status_code == 400  # not shaped
        for bad in (-1, 16, 1 << 21, 1.5, "512", True, None, float("nan")):
            body = {"rate_gbps": 0, "last_chunk": bad}
            if bad is None:
                body["last_chunk"] = [512]
            r = requests.post(p_int8.url + "/kv_transfer_link", data=json.dumps(body, allow_nan=True), timeout=30,
                              headers={"Content-Type": "application/json"})
            assert r.status_code == 400, (bad, r.status_code, r.text)
        r = requests.post(p_int8.url + "/kv_transfer_link", json={"rate_gbps": 0, "last_chunk": 0}, timeout=30)
        assert r.status_code == 200 and "last chunk 0" in r.text, r.text
    finally:
        stop_all(router, p_end, p_int8, d, s)


# ---------------------------------------------------------------- several workers, one killed
@pytest.mark.heavy  # tens of seconds on 2 cores; CI runs -m "not heavy" (README, Tests)
def test_two_prefills_two_decodes_survive_a_killed_decode(cluster):
    bp = free_port()
    p3, d3 = start_all([(pd_args("prefill", bp), None, "pd_prefill_2"), (pd_args("decode"), None, "pd_decode_2")])
    router = None
    try:
        router = start_router([(cluster["P"].url, cluster["bp"]), (p3.url, bp)], [cluster["D"].url, d3.url],
                              policy="round_robin")
        ref = {p: post(cluster["S"].url, greedy(p))["output_ids"] for p in PROMPTS}
        results, errors = [], []

        def client(i):
            try:
                prompt = PROMPTS[i % len(PROMPTS)]
                results.append((prompt, post(router.url, greedy(prompt), timeout=300)["output_ids"]))
            except Exception as e:  # noqa: BLE001 (collected and asserted below)
                errors.append(repr(e))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(12)]
        for t in threads[:6]:
            t.start()
        time.sleep(2.0)
        d3.proc.kill()  # mid-run: some requests are on it
        for t in threads[6:]:
            t.start()
            time.sleep(0.3)
        for t in threads:
            t.join(timeout=scaled(600))
        assert not errors, errors
        assert len(results) == 12 and all(out == ref[p] for p, out in results)
    finally:
        stop_all(router, p3, d3)


# ---------------------------------------------------------------- peer deaths under load (disagg/peers.py)
LONG_PROMPT = PROMPTS[0] * 14  # ~1.4k tokens
PATIENT = "300"  # --kv-transfer-timeout of the servers below: a room fails fast only by a probe
# peers.py: 2 failed probes 1 s apart (~2 s), plus one scheduler step, which lasts many seconds on a
# shared 2-core machine under load (a 128-token chunk: ~1 s idle, 20 s at a load of 20); far below
# the PATIENT timeout that is the bound without the probes
DETECT_S = 45.0
ROOMS_END_S = 60  # after the death is seen, the dead peer's claimed rooms end within this
# --kv-transfer-timeout of the prefill whose decode is killed: above DETECT_S + ROOMS_END_S, so
# the rooms' own timeout cannot beat the probe inside the test's window (the decode registered
# every room on arrival, claimed or not, so the probe ends them all); below PATIENT.
UNCLAIMED_S = "120"


def _kv(handle) -> dict:
    """The kv_transfer state, {} while the scheduler is too busy to answer (internal_states [])."""
    states = server_info(handle)["internal_states"]
    return states[0].get("kv_transfer", {}) if states else {}


def _kv_used(handle) -> int:
    states = server_info(handle)["internal_states"]
    return states[0]["kv_used_tokens"] if states else -1


def _wait(cond, limit, what):
    deadline = time.time() + limit
    while not cond():
        assert time.time() < deadline, what
        time.sleep(0.1)
    return time.time()


def _kill_tree(handle):
    kids = handle.children()
    handle.proc.kill()
    for k in kids:
        try:
            k.kill()
        except Exception:  # noqa: BLE001 (already gone with its parent)
            pass


@pytest.mark.heavy  # minutes on 2 cores; CI runs -m "not heavy" (README, Tests)
@pytest.mark.timeout(1800)  # 8 long local prefills on a loaded shared CPU
def test_prefill_killed_under_load_every_request_ends(cluster):
    """2 prefills + 1 decode behind the real router, 8 requests of ~1.4k tokens in flight, one
    prefill SIGKILLed: its rooms fail on the decode within DETECT_S and are prefilled there;
    every client gets the single server's answer (or a clear error naming the prefill); the
    decode's KV held by no request returns to zero; each fallback is counted."""
    bp = free_port()
    p2, d = start_all([([*pd_args("prefill", bp), "--kv-transfer-timeout", PATIENT], None, "pd_prefill_killed"),
                       ([*pd_args("decode"), "--kv-transfer-timeout", PATIENT], None, "pd_decode_patient")])
    cluster = {**cluster, "D": d}
    router = None
    try:
        router = start_router([(cluster["P"].url, cluster["bp"]), (p2.url, bp)], [d.url], policy="round_robin")
        before = {k: metric(d, k) for k in ("kv_transfer_fallbacks_total", "kv_transfer_peer_failures_total")}
        results = []

        def client(i):
            t = time.time()
            try:
                r = requests.post(router.url + "/generate", json=greedy(LONG_PROMPT, max_new=8), timeout=900)
                results.append((r.status_code, r.json(), time.time() - t))
            except Exception as e:  # noqa: BLE001 (asserted below)
                results.append((None, repr(e), time.time() - t))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        _wait(lambda: _kv(p2).get("rooms_open", 0) > 0, 300, "no room on P2")
        killed = time.time()
        _kill_tree(p2)
        seen = _wait(lambda: metric(cluster["D"], "kv_transfer_peer_failures_total") > before[
            "kv_transfer_peer_failures_total"], 120, "the decode never saw the prefill die")
        assert seen - killed < DETECT_S, f"prefill death seen after {seen - killed:.1f} s"
        for t in threads:
            t.join(900)
        assert len(results) == 8, results
        ref = post(cluster["S"].url, greedy(LONG_PROMPT, max_new=8), timeout=900)["output_ids"]
        fallbacks = 0
        for status, body, _ in results:
            if status == 200:
                assert body["output_ids"] == ref
                fallbacks += body["meta_info"]["kv_transfer"]["status"].startswith("fallback")
            else:
                assert status is not None and "prefill" in json.dumps(body), (status, body)
        assert fallbacks >= 1
        # each decode request is counted once; the router's retries of requests whose prefill
        # connection broke are decode requests of their own (counted, though no client reads them)
        assert metric(cluster["D"], "kv_transfer_fallbacks_total") - before["kv_transfer_fallbacks_total"] >= fallbacks
        # the KV held by no request returns to zero (flushing empties the radix cache); staging
        # regions of rooms a live prefill failed stay quarantined for --kv-transfer-timeout
        _wait(lambda: requests.post(d.url + "/flush_cache", timeout=60).status_code == 200
              and _kv(d).get("rooms_open") == 0 and _kv_used(d) == 0,
              120, "KV left on the decode")
    finally:
        stop_all(router, p2, d)


@pytest.mark.heavy  # minutes on 2 cores; CI runs -m "not heavy" (README, Tests)
@pytest.mark.timeout(1800)
def test_decode_killed_its_rooms_end_fast_on_the_prefill(cluster):
    """A decode SIGKILLed with claimed rooms: the prefill sees the decode die within DETECT_S and
    ends its rooms at once naming it (not after --kv-transfer-timeout), those it had registered
    for but not claimed yet too; every client's request ends with an error naming the decode
    (the router's 5xx)."""
    bp = free_port()
    assert float(UNCLAIMED_S) > DETECT_S + ROOMS_END_S
    p, d2 = start_all([([*pd_args("prefill", bp), "--kv-transfer-timeout", UNCLAIMED_S], None, "pd_prefill_patient"),
                       ([*pd_args("decode"), "--kv-transfer-timeout", PATIENT], None, "pd_decode_killed")])
    cluster = {**cluster, "P": p}
    router = None
    try:
        router = start_router([(p.url, bp)], [d2.url])
        before = metric(p, "kv_transfer_peer_failures_total")
        results = []

        def client():
            t = time.time()
            try:
                r = requests.post(router.url + "/generate", json=greedy(LONG_PROMPT, max_new=64), timeout=900)
                results.append((r.status_code, r.text, time.time() - t))
            except Exception as e:  # noqa: BLE001
                results.append((None, repr(e), time.time() - t))

        threads = [threading.Thread(target=client) for _ in range(4)]
        for t in threads:
            t.start()
        _wait(lambda: _kv(d2).get("staging_used_bytes", 0) > 0, 300, "D2 claimed no room")
        killed = time.time()
        _kill_tree(d2)
        seen = _wait(lambda: metric(p, "kv_transfer_peer_failures_total") > before, 120,
                     "the prefill never saw the decode die")
        assert seen - killed < DETECT_S, f"decode death seen after {seen - killed:.1f} s"
        # the rooms it had registered for (claimed or not) end now, by the probe
        _wait(lambda: _kv(p).get("rooms", {}).get("failed:decode unreachable", 0) > 0, ROOMS_END_S,
              "the prefill kept the dead decode's claimed rooms")
        for t in threads:
            t.join(900)
        for status, text, took in results:
            assert status != 200 and status is not None, (status, text)
            assert "ecode" in text, text  # the router names the decode it lost
    finally:
        stop_all(router, p, d2)


# ---------------------------------------------------------------- a decode dead before it registers
ROUTER_ATTEMPTS = 2  # the routers below run with --retry-max-retries 2 (default 5); sglang-router
# 0.3.2 counts every attempt in it (its --disable-retries sets it to 1); each attempt opens a new
# room on the same dead decode
NEVER = "3600"  # --kv-transfer-timeout of the prefill below: only the claim deadline can end its rooms


@pytest.mark.heavy  # a fault run of about a minute on 2 cores: CI leaves it out (README, Tests)
@pytest.mark.timeout(1800)
def test_a_decode_dead_before_it_registers_fails_fast_naming_the_decode():
    """The decode is SIGKILLed; the real router, whose health checks run at its default interval
    (60 s), still sends it requests. The decode's connection is refused at once, but the router
    answers only once the prefill's reply has ended: the prefill ends each room that no decode
    registered for at --kv-claim-timeout (not at --kv-transfer-timeout), so each attempt takes
    the claim deadline (plus the short prompt's prefill and a scheduler step), and the client gets
    the router's 502 naming the decode within ROUTER_ATTEMPTS of them. Each room is counted once
    on the prefill, and its KV held by no request returns to zero."""
    claim = round(scaled(3))
    bp = free_port()
    p, d = start_all([([*pd_args("prefill", bp), "--kv-transfer-timeout", NEVER, "--kv-claim-timeout", str(claim)],
                       None, "pd_prefill_claim"), (pd_args("decode"), None, "pd_decode_dies")])
    routers = []
    try:
        # one router per request: the router's circuit breaker (10 failures) counts the retries
        # of both, and once open it answers "No available prefill workers" whatever failed
        routers = [start_router([(p.url, bp)], [d.url], name=f"router_claim_{i}", health_check_interval_secs=60,
                                extra_args=("--retry-max-retries", str(ROUTER_ATTEMPTS))) for i in range(2)]
        post(routers[0].url, greedy(PROMPTS[2]))  # the pair works
        _kill_tree(d)
        d.proc.wait(30)
        failed = _kv(p)["rooms"].get("failed:decode unreachable", 0)
        aborted = _kv(p)["rooms"].get("failed:aborted", 0)
        before = {k: metric(p, k) for k in ("kv_transfer_rooms_failed_total", "kv_transfer_peer_failures_total",
                                            "num_aborted_requests_total")}
        # the claim deadline, plus the prompt's prefill and one scheduler step on this machine now
        per_attempt = claim + scaled(10)
        bound = ROUTER_ATTEMPTS * per_attempt
        assert bound < float(NEVER)

        t = time.time()
        r = requests.post(routers[0].url + "/generate", json=greedy(PROMPTS[2]), timeout=bound + 60)
        took = time.time() - t
        print(f"non-streaming: {r.status_code} after {took:.1f} s (--kv-claim-timeout {claim} s, bound "
              f"{bound:.0f} s): {r.text}")
        assert r.status_code == 502, r.text
        err = r.json()["error"]
        assert err["code"] == "decode_server_error" and err["message"].startswith("Decode server error"), err
        assert took < bound, f"the client waited {took:.1f} s (bound {bound:.0f} s)"
        rooms = _kv(p)["rooms"].get("failed:decode unreachable", 0) - failed
        assert 1 <= rooms <= ROUTER_ATTEMPTS  # one room per attempt that reached the prefill
        assert metric(p, "kv_transfer_rooms_failed_total") - before["kv_transfer_rooms_failed_total"] == rooms
        assert metric(p, "kv_transfer_peer_failures_total") == before["kv_transfer_peer_failures_total"]

        # streaming: the prefill's SSE headers come at once, so the router answers as soon as the
        # decode's connection is refused; it drops the prefill's stream, which aborts the room
        t = time.time()
        r = requests.post(routers[1].url + "/generate", json=greedy(PROMPTS[2], stream=True), timeout=bound + 60)
        took = time.time() - t
        print(f"streaming: {r.status_code} after {took:.1f} s: {r.headers.get('content-type')} {r.text}")
        assert r.status_code == 502, r.text
        err = r.json()["error"]
        assert err["code"] == "decode_server_error" and err["message"].startswith("Decode server error"), err
        assert took < bound
        # each attempt's room ends once, as an abort (the router dropped the prefill's stream)
        _wait(lambda: _kv(p)["rooms"].get("failed:aborted", 0) > aborted, scaled(60), "no room aborted")
        rooms = _kv(p)["rooms"].get("failed:aborted", 0) - aborted
        assert 1 <= rooms <= ROUTER_ATTEMPTS
        _wait(lambda: metric(p, "num_aborted_requests_total") - before["num_aborted_requests_total"] == rooms,
              scaled(60), "aborted requests not counted once each")
        _wait(lambda: requests.post(p.url + "/flush_cache", timeout=60).status_code == 200
              and _kv(p).get("rooms_open") == 0 and _kv_used(p) == 0 and not _kv(p).get("send_buffer_used_bytes"),
              scaled(120), "KV or rooms left on the prefill")
        print("prefill rooms:", _kv(p)["rooms"])
    finally:
        stop_all(*routers, p, d)
