"""PD disaggregation: prefill and decode servers that hand a request's KV over a transfer engine.

    bootstrap_server.py  the prefill node's directory of KV senders (its own process)
    role.py              PDRole: the hooks the Scheduler calls, and what a role may touch
    base.py              the room state machine (KVPoll) and the TransferEngine base
    mooncake.py          Mooncake's Transfer Engine (SGLang's default): TCP / RDMA, and NVLink
                         between GPUs of one host with its CUDA build
    buffers.py           the registered transfer buffers (host, or GPU with the CUDA build) and
                         their block checksums
    trace.py             the per-request phase trace (--enable-pd-trace)
    shaped.py            a link of a chosen rate and latency, paced inside the engine
    common.py            settings, bootstrap client, block checksums, counters
    sender.py            the prefill's sender thread (checksums, writes, notices)
    prefill.py, decode.py  the scheduler's prefill / decode roles (I/O and policy, no fork); each
                         role class mixes in its parts from the files below
    prefill_room.py      a prefill room's state, the wire constants (TIER_KEEP, the streams)
    prefill_send.py      decode messages in; packs, writes and KVDone out; write results
    prefill_chunks.py    chunk streams: untiered chunks and chunk tiers, side-stream packs, the final tiers
    prefill_endings.py   a prefill room's end: abort, dead decode, deadline, failure, finish
    decode_room.py       a decode room's state
    decode_receive.py    segments in: checksums launched, unpack, sums compared, acks
    decode_unpack.py     slots per tier, the row written; the request made ready to decode
    decode_fallback.py   a failed decode room: freed, quarantined, prefilled locally
    scd_prefill.py, scd_decode.py, scd_common.py
                         SCD over PD (--scd-artifacts): the prefill ships low-rank codes that
                         several decode servers with other weights rebuild their KV from
    scd_fanout.py        client side: one prefill's codes to N decode servers

The KV bytes are mem_cache/kv_payload.py segments; the control messages are message/disagg.py.
A new engine is a new file plus a line in TRANSFER_ENGINES; `fake` moves nothing (SGLang's
fake backend: no bootstrap server, the decode's KV is left unwritten).
"""
from __future__ import annotations

import importlib
import os

TRANSFER_ENGINES = {
    "mooncake": "sgl_kvxfer.disagg.mooncake:MooncakeTransferEngine",
}
TRANSFER_ALIASES = {"mooncake_tcp": "mooncake"}  # SGLang's: mooncake with MC_FORCE_TCP set
TRANSFER_BACKEND_CHOICES = (*TRANSFER_ENGINES, *TRANSFER_ALIASES, "fake")
DISAGGREGATION_MODES = ("null", "prefill", "decode")


def create_transfer_engine(name: str, host: str, rate_gbps: float = 0.0, latency_ms: float = 0.0,
                           ib_device: str | None = None, gpu_id: int = 0):
    """The engine for --disaggregation-transfer-backend, paced when a link rate is set."""
    if name == "mooncake_tcp":
        os.environ.setdefault("MC_FORCE_TCP", "1")  # before Mooncake's library loads
        ib_device = None
    name = TRANSFER_ALIASES.get(name, name)
    if name not in TRANSFER_ENGINES:
        raise ValueError(f"unknown transfer engine {name!r}; choose from {sorted(TRANSFER_ENGINES)}")
    module, cls = TRANSFER_ENGINES[name].split(":")
    engine = getattr(importlib.import_module(module), cls)(host, ib_device=ib_device, gpu_id=gpu_id)
    if rate_gbps > 0 or latency_ms > 0:
        from sgl_kvxfer.disagg.shaped import ShapedTransferEngine

        engine = ShapedTransferEngine(engine, rate_gbps, latency_ms)
    return engine


def create_disagg_role(settings, host: str):
    """The PD role for --disaggregation-mode (not started: the Scheduler starts it), or None."""
    if settings.mode == "prefill" and settings.scd_artifacts:
        from sgl_kvxfer.disagg.scd_prefill import ScdPrefillRole

        return ScdPrefillRole(settings, host)
    if settings.mode == "decode" and settings.scd_artifacts:
        from sgl_kvxfer.disagg.scd_decode import ScdDecodeRole

        return ScdDecodeRole(settings, host)
    if settings.mode == "prefill":
        from sgl_kvxfer.disagg.prefill import PrefillRole

        return PrefillRole(settings, host)
    if settings.mode == "decode":
        from sgl_kvxfer.disagg.decode import DecodeRole

        return DecodeRole(settings, host)
    return None
