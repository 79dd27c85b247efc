"""Hostile requests against the real HTTP stack (fake scheduler, no weights): every case of
hostile_requests.py gets its status in its route's JSON error shape, streaming or not, and
valid requests at the edge of every rule are served. The server answers /health afterwards."""
import json

import pytest
import requests
from hostile_requests import CHAT, CMPL, GEN, cases, valid_edge_cases

CASES = cases()
EDGES = valid_edge_cases()


@pytest.fixture(scope="module")
def server(fake_server):
    yield fake_server
    assert requests.get(fake_server.url + "/health", timeout=60).status_code == 200
    assert fake_server.proc.poll() is None


def send(url, case, **kw):
    return requests.post(url + case.route, data=case.body, headers={"Content-Type": case.content_type},
                         timeout=120, **kw)


def error_message(route: str, status: int, body) -> str:
    """The message of a 4xx/5xx body, asserting the route's shape (server/errors.py)."""
    assert isinstance(body, dict), body
    if "object" in body:  # OpenAI ErrorResponse: every route's JSON / size / 5xx errors
        assert body["object"] == "error" and body["code"] == status and body["param"] is None, body
        return body["message"]
    assert route == GEN, body  # /generate's own envelopes
    err = body["error"]
    return err if isinstance(err, str) else err["message"]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_request_is_refused_in_the_routes_shape(server, case):
    r = send(server.url, case)
    assert r.status_code == case.expect, (r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json")
    message = error_message(case.route, r.status_code, r.json())
    assert isinstance(message, str) and message


@pytest.mark.parametrize("case", EDGES, ids=[c.id for c in EDGES])
def test_request_at_the_edge_of_every_rule_is_served(server, case):
    r = send(server.url, case, stream=True)
    assert r.status_code == 200, r.text[:300]
    if b'"stream": true' not in case.body:
        body = r.json()
        assert "choices" in body if case.route in (CMPL, CHAT) else "meta_info" in json.dumps(body)
        return
    frames = r.content.split(b"\n\n")
    assert frames[-2:] == [b"data: [DONE]", b""], frames[-3:]
    assert not any(b'"error"' in f for f in frames)


def test_messages_name_the_field_as_the_client_spelled_it(server):
    for route, body, needle in (
            (GEN, {"text": "a", "sampling_params": {"top_p": 5}}, "`sampling_params.top_p`"),
            (CMPL, {"prompt": "a", "max_tokens": "5"}, "`max_tokens`"),
            (CMPL, {"prompt": "a", "seed": 2**70}, "`seed`"),
            (CHAT, {"messages": [{"role": "user", "content": "a"}], "min_tokens": -1}, "`min_tokens`"),
            (CHAT, {"messages": [{"role": "user"}]}, "`messages[0].content` is required"),
            (CHAT, {"messages": [{"role": "user", "content": "a"}], "stream_options": {"include_usage": 1}},
             "`stream_options.include_usage`"),
            (CHAT, {"messages": [{"role": "user", "content": "a"}], "response_format": {"type": "json_schema"}},
             "would not be enforced")):
        r = requests.post(server.url + route, json=body, timeout=60)
        assert r.status_code == 400 and needle in r.text, (route, r.text)


def test_one_rule_one_message_on_every_route(server):
    """The same bad value gets the same words from /generate and both OpenAI routes."""
    texts = set()
    for route, body in ((GEN, {"text": "a", "sampling_params": {"top_k": 0}}), (CMPL, {"prompt": "a", "top_k": 0}),
                        (CHAT, {"messages": [{"role": "user", "content": "a"}], "top_k": 0})):
        r = requests.post(server.url + route, json=body, timeout=60)
        message = error_message(route, r.status_code, r.json())
        texts.add(message.replace("sampling_params.", ""))
    assert texts == {"`top_k` must be -1 (all) or in [1, 1073741824], got 0"}
