"""SIGTERM with requests in flight, over the real HTTP stack (fake scheduler): the bytes every
client receives. Short requests finish inside the grace period; long ones end with a 503 in
their route's shape (streams: an error event, then `data: [DONE]`); new requests get a 503 at
once; the process tree exits soon after the grace period."""
import json
import signal
import threading
import time

import requests
from conftest import start_server

GRACE = 4.0
SHORT, LONG = 20, 2000  # tokens; the fake scheduler makes one every ~5 ms per request


def _bodies(max_new: int):
    chat = [{"role": "user", "content": "hi"}]
    return [
        ("/generate", {"text": "a b", "sampling_params": {"max_new_tokens": max_new}, "stream": True}),
        ("/generate", {"text": ["a", "b"], "sampling_params": {"max_new_tokens": max_new}, "stream": True}),
        ("/v1/chat/completions", {"messages": chat, "max_tokens": max_new, "stream": True}),
        ("/v1/completions", {"prompt": "a", "max_tokens": max_new, "stream": True}),
        ("/generate", {"text": "a b", "sampling_params": {"max_new_tokens": max_new}}),
        ("/v1/chat/completions", {"messages": chat, "max_tokens": max_new}),
        ("/v1/completions", {"prompt": "a", "max_tokens": max_new}),
    ]


def _client(url, route, body, out):
    try:
        r = requests.post(url + route, json=body, timeout=120)
        out.append((route, body, r.status_code, r.content))
    except requests.RequestException as e:  # noqa: BLE001 (asserted: none may happen)
        out.append((route, body, None, repr(e).encode()))


def _frames(raw: bytes) -> list[bytes]:
    frames = raw.split(b"\n\n")
    assert frames[-1] == b"", raw[-200:]
    return frames[:-1]


def test_sigterm_finishes_short_requests_and_ends_long_ones_with_503():
    handle = start_server(["--log-level", "warning", "--shutdown-grace-period-secs", str(GRACE)], fake=True,
                          name="fake_drain")
    url, results, threads = handle.url, [], []
    try:
        for max_new in (SHORT, LONG):
            for route, body in _bodies(max_new):
                threads.append(threading.Thread(target=_client, args=(url, route, body, results)))
        for t in threads:
            t.start()
        deadline = time.time() + 60
        while requests.get(url + "/get_server_info", timeout=30).json()["internal_states"][0]["num_running_reqs"] < 8:
            assert time.time() < deadline, "the long requests did not start"
            time.sleep(0.05)
        t0 = time.time()
        handle.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        late = requests.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=30)
        assert late.status_code == 503 and late.json()["object"] == "error", late.text
        assert "shutting down" in late.json()["message"]
        assert requests.get(url + "/health", timeout=30).status_code == 503
        for t in threads:
            t.join(60)
        assert handle.proc.wait(GRACE + 20) == 0
        assert time.time() - t0 < GRACE + 15
    finally:
        handle.stop()

    assert len(results) == 2 * len(_bodies(0)) and all(status is not None for _, _, status, _ in results), results
    for route, body, status, raw in results:
        max_new = (body.get("sampling_params") or {}).get("max_new_tokens") or body.get("max_tokens")
        if body.get("stream"):
            assert status == 200
            frames = _frames(raw)
            assert frames[-1] == b"data: [DONE]", (route, frames[-3:])
            events = [json.loads(f[len(b"data: "):]) for f in frames[:-1]]
            errors = [e for e in events if "error" in e]
            if max_new == SHORT:
                assert not errors, (route, errors)
            else:
                assert len(errors) == 1 and events[-1] is errors[0], (route, events[-2:])
                assert errors[0]["error"]["code"] == 503 and "shutting down" in errors[0]["error"]["message"]
        elif max_new == SHORT:
            assert status == 200, (route, raw[:300])
            reply = json.loads(raw)
            assert (reply.get("meta_info") or reply.get("usage"))
        else:
            assert status == 503, (route, raw[:300])
            reply = json.loads(raw)
            assert reply["object"] == "error" and reply["code"] == 503 and "shutting down" in reply["message"]
