"""What both PD roles share: settings, the bootstrap client, counters, faults."""
from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass

from sgl_kvxfer import env

logger = logging.getLogger(__name__)

FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # SGLang: "no prefill peer" (health checks, bench --fake-prefill)


@dataclass(frozen=True)
class DisaggSettings:
    """The PD slice of SchedulerConfig (config.py) a role needs."""
    mode: str
    bootstrap_port: int
    backend: str
    timeout_s: float
    buffer_bytes: int
    stream: str  # b < 1: "end", "int8", "chunk" or "chunk-upgrade" (prefill.py)
    rate_gbps: float
    latency_ms: float
    scd_artifacts: str | None = None  # SCD over PD (disagg/scd_*.py)
    scd_consumer: str | None = None
    scd_fanout: int = 1
    scd_rank: str = "top"
    scd_wire_frac: float = 0.25
    ib_device: str | None = None  # --disaggregation-ib-device (disagg/mooncake.py)
    gpu_id: int = 0  # --base-gpu-id: picks this GPU's HCAs from an ib-device mapping
    trace: bool = False  # --enable-pd-trace (disagg/trace.py)
    claim_timeout_s: float = 5.0  # --kv-claim-timeout (prefill.py)
    last_chunk: int = 0  # --kv-transfer-last-chunk (prefill_chunks.py: last_chunk_tokens)
    stream_chunk: int = 0  # --kv-transfer-stream-chunk (prefill_chunks.py: stream_chunk_tokens)
    scd_min_rank: str | None = None  # --scd-min-rank: --scd-rank auto's floor level (scd/rank_policy.py)

    @property
    def claim_deadline_s(self) -> float:
        """Seconds a prefill room may wait for a decode to register: a room without progress
        fails at timeout_s anyway."""
        return min(self.claim_timeout_s, self.timeout_s)

    @classmethod
    def from_config(cls, cfg) -> "DisaggSettings":
        return cls(cfg.disaggregation_mode, cfg.disaggregation_bootstrap_port, cfg.disaggregation_transfer_backend,
                   cfg.kv_transfer_timeout, int(cfg.kv_transfer_buffer_mb) << 20, cfg.resolved_kv_transfer_stream,
                   cfg.kv_transfer_rate_gbps, cfg.kv_transfer_latency_ms, cfg.scd_artifacts, cfg.scd_consumer,
                   cfg.scd_fanout, cfg.scd_rank, cfg.scd_wire_frac, cfg.disaggregation_ib_device,
                   cfg.engine.base_gpu_id, cfg.enable_pd_trace, cfg.kv_claim_timeout,
                   cfg.kv_transfer_last_chunk, stream_chunk=cfg.kv_transfer_stream_chunk,
                   scd_min_rank=cfg.scd_min_rank)


# ---------------------------------------------------------------- bootstrap server client
def _http_json(method: str, url: str, body: dict | None = None, timeout: float = 5.0):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode()


def register_prefill_rank(host: str, port: int, registration: dict, attempts: int = 20) -> None:
    """PUT /route on the local bootstrap server, retried while it starts."""
    url = f"http://{host}:{port}/route"
    for i in range(attempts):
        try:
            _http_json("PUT", url, registration)
            return
        except (urllib.error.URLError, OSError) as e:
            if i == attempts - 1:
                raise RuntimeError(f"cannot register with the bootstrap server at {url}: {e}") from e
            time.sleep(min(0.1 * 2 ** i, 2.0))


def fetch_prefill_route(host: str, port: int, timeout: float = 5.0) -> dict:
    """The prefill's parallel info merged with rank 0's endpoint (decode side, in a worker
    thread). Raises OSError / urllib errors while the prefill is unreachable or not ready."""
    base = f"http://{host}:{port}/route?prefill_dp_rank={{}}&prefill_cp_rank={{}}&target_tp_rank={{}}&target_pp_rank={{}}"
    info = _http_json("GET", base.format(-1, -1, -1, -1), timeout=timeout)
    rank = _http_json("GET", base.format(0, 0, 0, 0), timeout=timeout)
    return {**info, **rank}


# ---------------------------------------------------------------- counters
class TransferStats:
    """Counters both roles keep; rendered under `kv_transfer` in /server_info and /metrics."""

    def __init__(self):
        self.rooms = Counter()  # outcome -> count ("ok", "failed:<reason>", "fallback:<reason>")
        self.bytes = 0
        self.tokens = 0
        self.segments = 0
        self.peer_failures = 0  # peers seen dying (disagg/peers.py)

    def outcome(self, name: str) -> None:
        self.rooms[name] += 1

    def moved(self, nbytes: int, tokens: int = 0) -> None:
        self.bytes += nbytes
        self.tokens += tokens
        self.segments += 1

    def to_dict(self, **extra) -> dict:
        return {"rooms": dict(self.rooms), "bytes": self.bytes, "tokens": self.tokens, "segments": self.segments,
                "bytes_per_token": self.bytes / self.tokens if self.tokens else 0.0,
                "fallbacks": sum(n for k, n in self.rooms.items() if k.startswith("fallback")),
                "peer_failures": self.peer_failures, **extra}


@dataclass(frozen=True)
class Fault:
    """A fault the prefill's sender injects into KV writes (tests only), from
    SGL_KVXFER_KV_TRANSFER_FAULT: comma-separated `kind[:seconds][@room]` entries, kind one of
    corrupt (flip a byte after checksumming), truncate (write half the bytes), delay:<s> (sleep
    before the write); `@room` limits an entry to one bootstrap room, else it hits every room."""
    kind: str = ""
    arg: float = 0.0
    room: int | None = None

    @staticmethod
    def parse(raw: str | None) -> list["Fault"]:
        faults = []
        for entry in filter(None, (e.strip() for e in (raw or "").split(","))):
            spec, _, room = entry.partition("@")
            kind, _, arg = spec.partition(":")
            if kind not in ("corrupt", "truncate", "delay"):
                raise ValueError(f"{env.KV_TRANSFER_FAULT.name}: bad entry {entry!r} "
                                 "(expected corrupt, truncate or delay:<s>, optionally @<room>)")
            faults.append(Fault(kind, float(arg or 0.0), int(room) if room else None))
        return faults

    @staticmethod
    def for_room(faults: list["Fault"], room: int) -> "Fault":
        return next((f for f in faults if f.room in (None, room)), Fault())
