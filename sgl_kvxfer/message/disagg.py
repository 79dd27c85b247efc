"""PD disaggregation control messages: which room, which bytes, done or failed.

Travels over ZMQ PUSH/PULL on tcp:// between the scheduler processes of a prefill server and a
decode server (the KV bytes themselves go through the transfer engine, never through ZMQ):

    decode KV manager ──KVRegister / KVClaim / KVAck / KVCancel──▶ prefill KV manager   (destination "kv_prefill")
    prefill KV manager ──KVSegment / KVDone / KVFailed──▶ decode KV manager (destination "kv_decode")

One room is one request's KV: `bootstrap_room` from the router. A decode server claims a room by
giving the prefill a region of its registered staging buffer; the prefill writes segments (token
ranges of the prompt's KV, packed by mem_cache/kv_payload.py) into that region as a ring and
announces each one; the decode verifies, unpacks and acks it, which frees its ring bytes.
"""
from __future__ import annotations

import msgspec


class BootstrapInfo(msgspec.Struct):
    """Where a request's KV comes from (decode) or goes (prefill): the router's three fields."""
    host: str
    port: int | None  # None: the receiver's own --disaggregation-bootstrap-port
    room: int


class KVLayoutInfo(msgspec.Struct, frozen=True):
    """What both pools must agree on for KV bytes to mean the same thing on both sides."""
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    group_size: int


class ScdClaimInfo(msgspec.Struct, frozen=True):
    """An SCD consumer's claim: it rebuilds KV from codes of these artifacts (disagg/scd_*.py)."""
    manifest_id: str  # sha256 of the artifacts' manifest.json and producer.safetensors
    consumer: str  # its name in the manifest


# ---------------------------------------------------------------- to the prefill KV manager
class KVRegister(msgspec.Struct, tag=True):
    """The decode holds the request of `room` and will claim it once it has staging and a
    request row (which may wait on its load). Sent as soon as the decode knows the prefill's
    endpoint: from then on the prefill watches that decode's liveness for the room, and a room
    no decode registered for within --kv-claim-timeout ends (the decode died or never got it)."""
    room: int
    decode_id: str  # the decode KV manager's reply endpoint (tcp://), as in its later KVClaim


class KVClaim(msgspec.Struct, tag=True):
    room: int
    decode_id: str  # the claiming decode KV manager (its reply endpoint)
    reply_to: str  # tcp://host:port the prefill pushes KVSegment / KVDone / KVFailed to
    session: str  # the decode's transfer-engine session ("host:port")
    region_addr: int  # this room's ring: [region_addr, region_addr + region_bytes) of the staging
    region_bytes: int
    prompt_len: int
    layout: KVLayoutInfo
    scd: ScdClaimInfo | None = None  # SCD: send codes (mem_cache/scd_payload.py), not KV


class KVAck(msgspec.Struct, tag=True):
    """The decode unpacked segment `seq`: its ring bytes may be written again."""
    room: int
    decode_id: str
    seq: int


class KVCancel(msgspec.Struct, tag=True):
    """The decode gave up on the room (failure, abort, or no KV needed): stop sending."""
    room: int
    decode_id: str
    reason: str


# ---------------------------------------------------------------- to the decode KV manager
class KVSegment(msgspec.Struct, tag=True):
    """Prompt positions [start, end) landed at `offset` of the room's ring, `nbytes` long, as
    consecutive blocks of `block_bytes` (the last may be short), each with its checksum of
    `checksum_kind` (disagg/buffers.py: "xxh3", or "wsum64" for bytes in GPU memory).

    `tiers`: one tier id (spectrum/tiers.py) per position, None when all are at the model dtype.
    `lens`: tokens per tier (fp16, int8, int4) in the packed payload; dropped positions hold no
    bytes. `replaces`: the positions were sent before (streamed ahead of their final tiers) and
    take these tiers now; TIER_KEEP (255) keeps what the decode holds.
    `codes`: the payload is SCD codes of the positions (mem_cache/scd_payload.py; tiers None,
    lens unused), from which an SCD consumer rebuilds their KV."""
    room: int
    seq: int
    start: int
    end: int
    tiers: bytes | None
    lens: tuple[int, int, int]
    offset: int
    nbytes: int
    block_bytes: int
    checksums: list[int]
    replaces: bool = False
    codes: bool = False
    checksum_kind: str = "xxh3"


class KVDone(msgspec.Struct, tag=True):
    """Every segment of the room is out; the first sampled token (and its logprob entries)."""
    room: int
    segments: int
    first_token: int
    cached_tokens: int
    wire_bytes: int
    output_token_logprob: list | None = None  # [logprob, token_id]
    output_top_logprobs: list | None = None
    output_token_ids_logprobs: list | None = None
    wire_seconds: float = 0.0  # summed engine write times of the room's segments
    tail_seconds: float = 0.0  # prompt done -> last segment written (transfer not hidden by compute)
    trace: list | None = None  # --enable-pd-trace: the prefill's spans [name, start, end] (disagg/trace.py)


class KVFailed(msgspec.Struct, tag=True):
    room: int
    reason: str


ToKVPrefill = KVRegister | KVClaim | KVAck | KVCancel
ToKVDecode = KVSegment | KVDone | KVFailed
