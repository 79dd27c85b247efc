"""The bootstrap server: a prefill node's directory of its KV senders (SGLang's HTTP API).

Runs as its own process on the prefill node, at `--host:--disaggregation-bootstrap-port`,
spawned by the launcher before the scheduler (which registers into it). It is a private
prefill <-> decode channel: the router never calls it (docs: sglang-compat section 4.4).

    PUT  /route               a prefill rank registers: rank_ip, rank_port (its ZMQ endpoint),
                              page_size, kv_cache_dtype, ... plus `kv_layout_info`,
                              `transfer_session` (what a decode needs to claim and receive) and,
                              on an SCD producer, `scd` (the artifacts it encodes with)
    GET  /route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1
                              the parallel info (503 until every expected rank registered)
    GET  /route?prefill_dp_rank=d&prefill_cp_rank=c&target_tp_rank=t&target_pp_rank=p
                              {"rank_ip", "rank_port", ...} of that rank (400 / 404)
    POST /register_dp_rank    {"bootstrap_room", "dp_rank"}
    POST /query_dp_ranks      {"bootstrap_rooms": [...]} -> {"<room>": dp_rank}
    GET  /health              "OK"

State is in memory and lost with the process; a restarted scheduler registers again.
"""
from __future__ import annotations

import logging
import threading

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

logger = logging.getLogger("sgl_kvxfer.bootstrap")

_QUERY_KEYS = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
_PARALLEL_KEYS = ("page_size", "kv_cache_dtype", "prefill_http_port", "decode_allocation_policy", "kv_layout",
                  "kv_layout_info", "transfer_backend", "scd")


def create_bootstrap_app(expected_ranks: int = 1) -> FastAPI:
    app = FastAPI(title="sgl_kvxfer bootstrap", openapi_url=None, docs_url=None, redoc_url=None)
    ranks: dict[tuple[int, int, int, int], dict] = {}  # (dp, cp, tp, pp) -> registration
    dp_of_room: dict[int, int] = {}
    lock = threading.Lock()

    @app.put("/route")
    async def register(request: Request):
        body = await request.json()
        key = tuple(int(body.get(k, 0)) for k in ("attn_dp_rank", "attn_cp_rank", "attn_tp_rank", "pp_rank"))
        with lock:
            ranks[key] = body
        logger.info("registered prefill rank %s at %s:%s", key, body.get("rank_ip"), body.get("rank_port"))
        return PlainTextResponse("OK")

    @app.get("/route")
    async def route(request: Request):
        q = request.query_params
        if any(k not in q for k in _QUERY_KEYS):
            return PlainTextResponse(f"missing one of {_QUERY_KEYS}", status_code=400)
        try:
            key = tuple(int(q[k]) for k in _QUERY_KEYS)
        except ValueError:
            return PlainTextResponse("rank arguments must be integers", status_code=400)
        with lock:
            regs = dict(ranks)
        if key == (-1, -1, -1, -1):
            if len(regs) < expected_ranks:
                return PlainTextResponse("prefill ranks not registered yet", status_code=503)
            first = next(iter(regs.values()))
            info = {"attn_tp_size": 1, "attn_cp_size": 1, "dp_size": 1, "pp_size": 1, "follow_bootstrap_room": True,
                    "enable_dsa_cache_layer_split": False, "enable_kv_cache_sharding": False}
            info.update({k: first.get(k) for k in _PARALLEL_KEYS if k in first})
            return JSONResponse(info)
        reg = regs.get(key)
        if reg is None:
            return PlainTextResponse(f"unknown prefill rank {key}", status_code=404)
        return JSONResponse({"rank_ip": reg.get("rank_ip"), "rank_port": reg.get("rank_port"),
                             "transfer_session": reg.get("transfer_session")})

    @app.post("/register_dp_rank")
    async def register_dp_rank(request: Request):
        body = await request.json()
        with lock:
            dp_of_room[int(body["bootstrap_room"])] = int(body["dp_rank"])
        return PlainTextResponse("OK")

    @app.post("/query_dp_ranks")
    async def query_dp_ranks(request: Request):
        body = await request.json()
        with lock:
            return JSONResponse({str(r): dp_of_room.get(int(r), 0) for r in body.get("bootstrap_rooms", [])})

    @app.get("/health")
    async def health():
        return PlainTextResponse("OK")

    return app


def run_bootstrap_server(host: str, port: int, log_level: str, ready_conn) -> None:
    """Process entry (spawned by launch_server): serve until killed; ack once bound."""
    import uvicorn

    logging.basicConfig(level=log_level.upper(), format="[bootstrap] %(asctime)s %(levelname)s %(message)s")
    config = uvicorn.Config(create_bootstrap_app(), host=host, port=port, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    try:
        server.config.load()
        sock = server.config.bind_socket()
    except (OSError, SystemExit) as e:
        ready_conn.send({"status": "error", "error": f"cannot bind the bootstrap server on {host}:{port}: {e}"})
        return
    ready_conn.send({"status": "ready"})
    server.run(sockets=[sock])
