"""HTTP-layer tests over the model-free fake scheduler: auth, exact error envelopes, SSE
framing, batch interleaving, disconnect abort, and process hygiene. Fast (no weights)."""
import glob
import gzip
import json
import os
import re
import tempfile
import time

import pytest
import requests
from servers import start_server

KEY, ADMIN = "sk-test", "sk-admin"


@pytest.fixture(scope="module")
def auth_server():
    handle = start_server(["--api-key", KEY, "--admin-api-key", ADMIN, "--enable-metrics", "--log-level", "warning"],
                          fake=True, name="fake_auth")
    yield handle
    handle.stop()


def test_auth(auth_server):
    url, bearer = auth_server.url, {"Authorization": f"Bearer {KEY}"}
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    r = requests.post(url + "/generate", json=body)
    assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
    assert requests.post(url + "/generate", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert requests.post(url + "/generate", json=body, headers={"Authorization": KEY}).status_code == 401
    assert requests.post(url + "/generate", json=body, headers={"Authorization": f"bearer {KEY}"}).status_code == 200
    assert requests.get(url + "/v1/models", headers=bearer).status_code == 200
    for path in ("/health", "/health_generate", "/ready"):  # probes: no data, no key
        assert requests.get(url + path).status_code == 200, path
    r = requests.get(url + "/metrics")  # the key guards everything else, the metrics too
    assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
    assert requests.get(url + "/metrics", headers=bearer).status_code == 200
    assert requests.post(url + "/flush_cache", headers=bearer).status_code == 401
    assert requests.post(url + "/flush_cache", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200
    for path in ("/start_profile", "/stop_profile"):  # admin routes, as in SGLang
        assert requests.post(url + path, headers=bearer).status_code == 401, path


def test_server_info_never_echoes_a_key(auth_server):
    r = requests.get(auth_server.url + "/get_server_info", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200
    assert KEY not in r.text and ADMIN not in r.text, r.json()["launch_command"]
    assert "--api-key <redacted>" in r.json()["launch_command"]


def test_error_envelopes(fake_server):
    url = fake_server.url
    r = requests.post(url + "/generate", json={"text": "a", "sampling_params": {"foo": 1}})
    assert r.status_code == 400 and isinstance(r.json()["error"], str) and r.json()["error"].startswith("unknown field `foo`")
    r = requests.post(url + "/generate", json={"text": "a", "sampling_params": {"top_p": 5}})
    assert r.status_code == 400 and "message" in r.json()["error"]
    r = requests.post(url + "/v1/chat/completions", json={"messages": 3})
    body = r.json()
    assert r.status_code == 400 and body["object"] == "error" and body["type"] == "Bad Request" and body["code"] == 400
    r = requests.get(url + "/no/such/route")
    assert r.status_code == 404 and r.json()["code"] == 404
    r = requests.get(url + "/v1/models/not-this-one")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_sse_framing_and_batch_index(fake_server):
    body = {"text": ["one two", "three"], "sampling_params": {"max_new_tokens": 4}, "stream": True}
    with requests.post(fake_server.url + "/generate", json=body, stream=True) as r:
        raw = r.content
    frames = raw.split(b"\n\n")
    assert frames[-1] == b"" and frames[-2] == b"data: [DONE]"
    events = [json.loads(f[6:]) for f in frames[:-2]]
    assert all(f.startswith(b"data: ") for f in frames[:-1])
    assert {e["index"] for e in events} == {0, 1}
    finals = {e["index"]: e for e in events if e["meta_info"]["finish_reason"]}
    assert finals[0]["meta_info"]["completion_tokens"] == 4 and finals[0]["text"] == "one twoone two"


def test_completion_stream_deltas_and_echo(fake_server):
    body = {"prompt": "ab cd", "max_tokens": 4, "stream": True, "echo": True}
    with requests.post(fake_server.url + "/v1/completions", json=body, stream=True) as r:
        lines = [l for l in r.iter_lines() if l]
    chunks = [json.loads(l[6:]) for l in lines[:-1]]
    assert lines[-1] == b"data: [DONE]"
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == "ab cd" + "ab cdab cd" and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "text_completion" for c in chunks)


def test_disconnect_aborts(fake_server):
    url = fake_server.url
    r = requests.post(url + "/generate", stream=True,
                      json={"text": "x y", "sampling_params": {"max_new_tokens": 2000}, "stream": True})
    assert r.status_code == 200
    lines = r.iter_lines()  # NOTE: keep a reference; a collected iterator closes the connection
    next(lines)
    assert requests.get(url + "/get_server_info").json()["internal_states"][0]["num_running_reqs"] == 1
    r.close()
    for _ in range(50):
        if requests.get(url + "/get_server_info").json()["internal_states"][0]["num_running_reqs"] == 0:
            break
        time.sleep(0.2)
    else:
        pytest.fail("disconnect did not abort the request")


def test_non_stream_disconnect_aborts(fake_server):
    url = fake_server.url
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(url + "/generate", json={"text": "x y", "sampling_params": {"max_new_tokens": 2000}}, timeout=1)
    for _ in range(40):  # the server polls for disconnects every couple of seconds
        if requests.get(url + "/get_server_info").json()["internal_states"][0]["num_running_reqs"] == 0:
            break
        time.sleep(0.25)
    else:
        pytest.fail("disconnect did not abort the non-streaming request")


def _metric(url, name, headers=None) -> float:
    text = requests.get(url + "/metrics", headers=headers, timeout=30).text
    m = re.search(rf"^sglang:{name}\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1))


def _wait_metric(url, name, target, timeout=30.0):
    deadline = time.time() + timeout
    while (value := _metric(url, name)) < target and time.time() < deadline:
        time.sleep(0.2)
    return value


def test_abort_counters_move_for_every_kind_of_abort(fake_server):
    url = fake_server.url
    before = _metric(url, "num_aborted_requests_total")
    # four streams (both route families) whose clients go away after the first event
    streams = []
    for route, body in (("/generate", {"text": "x y", "sampling_params": {"max_new_tokens": 1500}, "stream": True}),
                        ("/generate", {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 1500},
                                       "stream": True}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 1500, "stream": True})):
        r = requests.post(url + route, json=body, stream=True, timeout=60)
        lines = r.iter_lines()
        next(lines)
        streams.append((r, lines))
    for r, _ in streams:
        r.close()
    assert _wait_metric(url, "num_aborted_requests_total", before + 4) == before + 4  # the batch is 2
    # a non-streaming client that times out
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1500}, timeout=1)
    assert _wait_metric(url, "num_aborted_requests_total", before + 5) == before + 5
    # /abort_request (the scheduler ends it; counted once)
    import threading

    t = threading.Thread(target=requests.post, args=(url + "/generate",),
                         kwargs={"json": {"text": "x", "rid": "to-abort", "sampling_params": {"max_new_tokens": 1500}},
                                 "timeout": 60})
    t.start()
    time.sleep(0.5)
    assert requests.post(url + "/abort_request", json={"rid": "to-abort"}).status_code == 200
    t.join(30)
    assert _wait_metric(url, "num_aborted_requests_total", before + 6) == before + 6
    time.sleep(1.0)
    assert _metric(url, "num_aborted_requests_total") == before + 6  # none counted twice


def test_profile_routes(fake_server, tmp_path):
    url = fake_server.url
    r = requests.post(url + "/stop_profile")
    assert r.status_code == 400 and r.text == "No profile is running.\n"
    for body, word in (({"activities": ["CPU", "MEM"]}, "activities"), ({"num_steps": -1}, "num_steps"),
                       ({"num_steps": "2"}, "num_steps"), ({"start_step": 3}, "start_step"),
                       ({"output_dir": str(tmp_path / "f" / "sub")}, "output_dir"),
                       ({"output_dir": str(tmp_path / "nul\x00")}, "output_dir"), ({"profile_id": "../x"}, "profile_id"),
                       ({"with_stack": "yes"}, "with_stack"), ({"activities": [1]}, "activities")):
        (tmp_path / "f").write_text("")  # a file where output_dir needs a folder
        r = requests.post(url + "/start_profile", json={"activities": ["CPU"], **body})
        assert r.status_code == 400 and word in r.text, (body, r.text)
    # started by POST, stopped by POST: the trace is written before the reply
    r = requests.post(url + "/start_profile", json={"output_dir": str(tmp_path), "profile_id": "a"})
    assert r.status_code == 200 and r.text == "Start profiling.\n"
    r = requests.get(url + "/start_profile", json={"output_dir": str(tmp_path)})
    assert r.status_code == 400 and "already running" in r.text
    r = requests.post(url + "/stop_profile")
    assert r.status_code == 200 and r.text == "Stop profiling. This will take some time.\n"
    with gzip.open(tmp_path / "a-TP-0.trace.json.gz") as f:
        assert "traceEvents" in json.load(f)
    # num_steps: the capture ends by itself during a request, and /stop_profile has nothing to stop
    r = requests.post(url + "/start_profile", json={"output_dir": str(tmp_path), "profile_id": "b", "num_steps": 3,
                                                    "activities": ["CPU"], "record_shapes": True})
    assert r.status_code == 200
    body = {"text": "hello there", "sampling_params": {"max_new_tokens": 8}}
    assert requests.post(url + "/generate", json=body).status_code == 200
    deadline = time.monotonic() + 30
    while not (tmp_path / "b-TP-0.trace.json.gz").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (tmp_path / "b-TP-0.trace.json.gz").exists()
    assert requests.post(url + "/stop_profile").status_code == 400
    # a bare GET takes every default: the folder is the system's temp folder, the id a timestamp
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "*-TP-0.trace.json.gz")))
    assert requests.get(url + "/start_profile").status_code == 200
    assert requests.get(url + "/stop_profile").status_code == 200
    written = set(glob.glob(os.path.join(tempfile.gettempdir(), "*-TP-0.trace.json.gz"))) - before
    assert len(written) == 1
    os.remove(written.pop())


def test_sigterm_stops_all_children(auth_server):
    assert len(auth_server.children()) >= 2
    assert auth_server.stop() == []


def test_child_crash_takes_server_down():
    import signal

    handle = start_server(["--log-level", "warning"], fake=True, name="fake_crash")
    try:
        workers = [p for p in handle.children() if "spawn_main" in " ".join(p.cmdline())]
        assert len(workers) == 2
        os.kill(workers[0].pid, signal.SIGKILL)
        assert handle.proc.wait(30) != 0, "the launcher exits non-zero when a child dies"
        time.sleep(1)
        assert not workers[1].is_running() or workers[1].status() == "zombie"
    finally:
        assert handle.stop() == []


def test_the_routers_grpc_probe_is_closed_quietly_and_bad_http_still_answered(fake_server):
    """sglang-router probes each worker with an HTTP/2 (gRPC) preface: closed without uvicorn's
    "Invalid HTTP request received." warning; a malformed HTTP/1.1 request still gets its 400
    and its warning."""
    import socket
    from urllib.parse import urlparse

    def log_count():
        with open(fake_server.log_path, errors="replace") as f:
            return f.read().count("Invalid HTTP request received.")

    addr = (urlparse(fake_server.url).hostname, urlparse(fake_server.url).port)
    before = log_count()
    with socket.create_connection(addr, timeout=30) as s:
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        assert s.recv(100) == b""  # closed, no reply
    with socket.create_connection(addr, timeout=30) as s:
        s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 400")
    deadline = time.time() + 10
    while log_count() == before and time.time() < deadline:
        time.sleep(0.1)
    assert log_count() == before + 1  # the malformed request's warning only


@pytest.mark.heavy  # over 10 s on 2 cores: CI leaves it out (README, Tests)
def test_a_server_whose_port_was_taken_starts_on_another(monkeypatch):
    """free_port() cannot reserve its port: another process may bind it before the server does.
    start_server sees the bind error and starts the server again on a new port."""
    import socket

    import sgl_kvxfer.testing.servers as servers_mod

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    real_free_port, calls = servers_mod.free_port, []

    def free_port_taken_first():
        calls.append(1)
        return taken.getsockname()[1] if len(calls) == 1 else real_free_port()

    monkeypatch.setattr(servers_mod, "free_port", free_port_taken_first)
    try:
        handle = start_server(["--log-level", "warning"], fake=True, name="fake_port_taken")
        try:
            assert len(calls) == 2 and not handle.url.endswith(f":{taken.getsockname()[1]}")
            assert requests.get(handle.url + "/v1/models", timeout=10).status_code == 200
        finally:
            handle.stop()
    finally:
        taken.close()
