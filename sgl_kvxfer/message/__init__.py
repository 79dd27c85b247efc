"""Typed messages for all cross-process traffic, grouped by destination.

Process diagram (server mode):

    TokenizerManager --(to_scheduler)--> Scheduler --(to_detokenizer)--> Detokenizer
           ^                                                                |
           +------------------------(to_tokenizer)--------------------------+

One serializer (msgspec msgpack over tagged Structs); no pickle on any socket.
"""
from __future__ import annotations

import msgspec

from sgl_kvxfer.message.disagg import BootstrapInfo, ToKVDecode, ToKVPrefill
from sgl_kvxfer.sampling.params import SamplingParams


# ---------------------------------------------------------------- to the scheduler
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK_"  # /health's probe: the scheduler loop answers it on arrival


class TokenizedGenerateReq(msgspec.Struct, tag=True):
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    stream: bool = False
    bootstrap: BootstrapInfo | None = None  # PD: the router's bootstrap_host / port / room


class AbortReq(msgspec.Struct, tag=True):
    rid: str = ""
    abort_all: bool = False


class FlushCacheReq(msgspec.Struct, tag=True):
    pass


class GetInternalStateReq(msgspec.Struct, tag=True):
    pass


class SetKVLinkReq(msgspec.Struct, tag=True):
    """Re-pace a prefill server's shaped KV link (POST /kv_transfer_link), so one server pair
    serves a sweep of link rates (0: unpaced) and, with `stream`, of --kv-transfer-stream
    variants (rooms opened afterwards use it); with `trace`, whether rooms opened afterwards are
    traced (a server started with --enable-pd-trace only); with `last_chunk`, their
    --kv-transfer-last-chunk."""
    rate_gbps: float
    latency_ms: float = 0.0
    stream: str | None = None
    trace: bool | None = None
    last_chunk: int | None = None


class ProfileReq(msgspec.Struct, tag=True):
    """Start (POST /start_profile, SGLang's fields) or stop (POST /stop_profile) a torch.profiler
    trace of the scheduler (scheduler/profiler.py). None: the scheduler's default."""
    start: bool
    output_dir: str | None = None
    num_steps: int | None = None  # stop after this many steps that ran a forward
    activities: list[str] | None = None  # "CPU", "GPU"
    with_stack: bool = False
    record_shapes: bool = False
    profile_id: str | None = None


# ---------------------------------------------------------------- from the scheduler
class ReqOutput(msgspec.Struct):
    """One request's progress since the previous ReqOutput for the same rid.

    `new_output_ids` and the logprob lists are *deltas*; the detokenizer and the tokenizer
    manager accumulate them. `finish_reason` is None until the request ends; it is then an
    SGLang finish dict ({"type": "length"|"stop"|"abort", ...}).
    Logprob entries are [logprob | None, token_id]; top-logprob positions are lists of those.
    """
    rid: str
    new_output_ids: list[int]
    finish_reason: dict | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    num_retractions: int = 0
    # Detokenization options, copied from the request's SamplingParams.
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    input_token_logprobs: list[list] | None = None
    input_top_logprobs: list | None = None
    input_token_ids_logprobs: list | None = None
    output_token_logprobs: list[list] | None = None
    output_top_logprobs: list | None = None
    output_token_ids_logprobs: list | None = None
    extra_meta: dict | None = None  # merged into meta_info (e.g. PD's kv_transfer)


class BatchTokenIDOut(msgspec.Struct, tag=True):
    outputs: list[ReqOutput]


class InternalState(msgspec.Struct, tag=True):
    """Scheduler statistics for /server_info and /metrics."""
    max_total_num_tokens: int
    max_req_input_len: int
    num_running_reqs: int
    num_queue_reqs: int
    kv_used_tokens: int
    kv_cached_tokens: int
    kv_bytes_per_token: float
    last_gen_throughput: float
    cache_hit_rate: float
    extra: dict = {}


class FlushCacheResult(msgspec.Struct, tag=True):
    success: bool
    message: str = ""


class SetKVLinkResult(msgspec.Struct, tag=True):
    success: bool
    message: str = ""


class ProfileResult(msgspec.Struct, tag=True):
    success: bool
    message: str = ""


# ---------------------------------------------------------------- to the tokenizer manager
class BatchStrOut(msgspec.Struct, tag=True):
    """Detokenized outputs: `texts[i]` is the cumulative text of `outputs[i].rid` (stop-trimmed
    once finished)."""
    outputs: list[ReqOutput]
    texts: list[str]


ToScheduler = TokenizedGenerateReq | AbortReq | FlushCacheReq | GetInternalStateReq | SetKVLinkReq | ProfileReq
ToDetokenizer = BatchTokenIDOut | InternalState | FlushCacheResult | SetKVLinkResult | ProfileResult
ToTokenizer = BatchStrOut | InternalState | FlushCacheResult | SetKVLinkResult | ProfileResult

_encoder = msgspec.msgpack.Encoder()
_decoders = {
    "scheduler": msgspec.msgpack.Decoder(ToScheduler),
    "detokenizer": msgspec.msgpack.Decoder(ToDetokenizer),
    "tokenizer": msgspec.msgpack.Decoder(ToTokenizer),
    "kv_prefill": msgspec.msgpack.Decoder(ToKVPrefill),  # message/disagg.py
    "kv_decode": msgspec.msgpack.Decoder(ToKVDecode),
}


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes, destination: str):
    """Decode a message for `destination` in {"scheduler", "detokenizer", "tokenizer",
    "kv_prefill", "kv_decode"}."""
    return _decoders[destination].decode(data)
