"""Client side of one prefill, N specialists: a request's SCD codes consumed by several decode
servers (docs/pd_disaggregation.md, "SCD over PD"). The producer runs with --scd-fanout N.

    fanout_generate(body, decodes, router=URL)
        through sglang-router: the router picks (P, D1) and a room (it overwrites any
        bootstrap fields the client sends); D1's first streamed chunk names the room in
        meta_info.kv_transfer (bootstrap_host / _port / _room), and the same body with those
        fields then goes to every server in `decodes` directly. They claim codes the producer
        already holds: no second prefill. If D1's transfer fell back (no room named), the
        others compute locally (bootstrap_host 2.2.2.2).
    fanout_generate(body, decodes, prefill=(URL, BOOTSTRAP_PORT))
        no router: a fresh room; the body goes to P and every decode at once (what the router
        does for one decode).

Returns each decode server's final reply (the router's D1 first), as /generate JSON.
"""
from __future__ import annotations

import json
import random
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from sgl_kvxfer.disagg.common import FAKE_BOOTSTRAP_HOST


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _stream(url: str, body: dict, timeout: float, on_first_meta) -> dict:
    """POST a streamed /generate; calls on_first_meta(meta_info) at the first chunk; returns the
    last chunk (cumulative text, full meta_info)."""
    req = urllib.request.Request(url + "/generate", data=json.dumps({**body, "stream": True}).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    last, called = None, False
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            last = json.loads(line[5:])
            if "error" in last:
                raise RuntimeError(f"{url}: {last['error']}")
            if not called:
                called = True
                on_first_meta(last.get("meta_info", {}))
    if last is None:
        raise RuntimeError(f"{url}: no streamed chunk came back")
    return last


def fanout_generate(body: dict, decodes: list[str], router: str | None = None,
                    prefill: tuple[str, int] | None = None, timeout: float = 600.0) -> list[dict]:
    if (router is None) == (prefill is None):
        raise ValueError("give either router=URL or prefill=(URL, bootstrap_port)")
    body = {k: v for k, v in body.items() if not k.startswith("bootstrap_")}
    with ThreadPoolExecutor(len(decodes) + 1) as pool:
        if prefill is not None:
            url, port = prefill
            fields = {"bootstrap_host": urllib.parse.urlparse(url).hostname, "bootstrap_port": port,
                      "bootstrap_room": random.getrandbits(63)}
            futures = [pool.submit(_post, d, {**body, **fields}, timeout) for d in decodes]
            p = pool.submit(_post, url, {**body, **fields}, timeout)
            out = [f.result() for f in futures]
            p.result()  # a prefill failure surfaces here (the decodes fell back already)
            return out
        others = []

        def follow(meta: dict) -> None:
            kv = meta.get("kv_transfer", {})
            fields = ({k: kv[k] for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room")}
                      if "bootstrap_room" in kv else {"bootstrap_host": FAKE_BOOTSTRAP_HOST, "bootstrap_room": 0})
            others.extend(pool.submit(_post, d, {**body, **fields}, timeout) for d in decodes)

        first = _stream(router, body, timeout, follow)
        if not body.get("stream"):
            first.pop("index", None)
        return [first] + [f.result() for f in others]
