"""TokenizerManager: the HTTP process's asyncio front of the pipeline.

    HTTP handler --GenerateItem--> [tokenize, validate] --TokenizedGenerateReq--> scheduler
    detokenizer --BatchStrOut--> _handle_loop --> ReqState (cumulative) --> waiting handler

Invariants:
- `self._states` holds exactly the rids whose handler is still waiting; a handler that stops
  waiting (finish, disconnect, error) pops its rid, and if the request was unfinished it also
  sends AbortReq so the scheduler frees the request's KV.
- Round trips (internal state, flush) are FIFO: the scheduler answers in order, so each reply
  resolves every waiter registered before it was asked.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

from sgl_kvxfer.config import ServerArgs
from sgl_kvxfer.message import (AbortReq, BatchStrOut, FlushCacheReq, FlushCacheResult, GetInternalStateReq,
                                InternalState, SetKVLinkReq, SetKVLinkResult, TokenizedGenerateReq)
from sgl_kvxfer.message.disagg import BootstrapInfo
from sgl_kvxfer.message.queue import AsyncPullQueue, PushQueue
from sgl_kvxfer.sampling.params import SamplingParams
from sgl_kvxfer.tokenizer.generate_input import GenerateItem, RequestError
from sgl_kvxfer.tokenizer.metrics import ServerMetrics
from sgl_kvxfer.tokenizer.output_state import RequestOutputState

logger = logging.getLogger(__name__)
HEALTH_CHECK_TIMEOUT = 20.0
_DISCONNECT_POLL = 2.0


@dataclass
class ReqState:
    item: GenerateItem
    out: RequestOutputState
    input_ids: list[int]
    event: asyncio.Event = field(default_factory=asyncio.Event)
    created: float = field(default_factory=time.perf_counter)
    last_token_time: float = 0.0


class TokenizerManager:
    def __init__(self, server_args: ServerArgs, scheduler_info: dict, tokenizer):
        self.server_args = server_args
        self.info = scheduler_info
        self.tokenizer = tokenizer
        self.context_len = int(scheduler_info.get("context_len") or 0)
        self.max_req_input_len = int(scheduler_info.get("max_req_input_len") or self.context_len)
        self.vocab_size = int(scheduler_info.get("vocab_size") or 0)
        self.metrics = ServerMetrics()
        self.shutting_down = False
        self.last_receive_time = 0.0
        self._states: dict[str, ReqState] = {}
        self._state_waiters: list[asyncio.Future] = []
        self._flush_waiters: list[asyncio.Future] = []
        self._link_waiters: list[asyncio.Future] = []
        self._send = None
        self._recv = None
        self._loop_task = None

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._send = PushQueue(self.server_args.ipc_addr("scheduler_input"))
        self._recv = AsyncPullQueue(self.server_args.ipc_addr("tokenizer_input"), "tokenizer", bind=True)
        self._loop_task = asyncio.create_task(self._handle_loop())

    async def stop(self) -> None:
        self.shutting_down = True
        if self._loop_task is not None:
            self._loop_task.cancel()

    async def _handle_loop(self) -> None:
        while True:
            msg = await self._recv.get()
            self.last_receive_time = time.perf_counter()
            if isinstance(msg, BatchStrOut):
                for out, text in zip(msg.outputs, msg.texts):
                    state = self._states.get(out.rid)
                    if state is not None:
                        self._on_output(state, out, text)
            elif isinstance(msg, InternalState):
                self._resolve(self._state_waiters, msg)
            elif isinstance(msg, FlushCacheResult):
                self._resolve(self._flush_waiters, msg)
            elif isinstance(msg, SetKVLinkResult):
                self._resolve(self._link_waiters, msg)

    def _on_output(self, state: ReqState, out, text: str) -> None:
        now = time.perf_counter()
        if out.new_output_ids:
            if state.last_token_time == 0.0:
                self.metrics.ttft.observe(now - state.created)
            else:
                self.metrics.itl.observe((now - state.last_token_time) / len(out.new_output_ids))
            state.last_token_time = now
        state.out.add(out, text)
        if out.finish_reason is not None:
            aborted = out.finish_reason.get("type") == "abort"
            self.metrics.on_finish(out.prompt_tokens, out.completion_tokens, out.cached_tokens, now - state.created, aborted)
        state.event.set()

    @staticmethod
    def _resolve(waiters: list, value) -> None:
        for fut in waiters:
            if not fut.done():
                fut.set_result(value)
        waiters.clear()

    # ------------------------------------------------------------ generation
    def tokenize(self, item: GenerateItem) -> list[int]:
        if item.input_ids is not None:
            ids = item.input_ids
            if self.vocab_size and any(not 0 <= t < self.vocab_size for t in ids):
                raise RequestError(f"input_ids holds a token id outside the vocabulary [0, {self.vocab_size}).")
            return ids
        if self.tokenizer is None:
            raise RequestError("text input needs the tokenizer; the server runs with --skip-tokenizer-init.")
        return self.tokenizer.encode(item.text)

    def validate(self, item: GenerateItem, input_ids: list[int]) -> None:
        n = len(input_ids)
        if n == 0:
            raise RequestError("The prompt is empty.")
        if self.context_len and n >= self.context_len:
            raise RequestError(f"The input ({n} tokens) is longer than the model's context length ({self.context_len} tokens).")
        if self.max_req_input_len and n > self.max_req_input_len:
            raise RequestError(f"The input ({n} tokens) is longer than the server's limit of {self.max_req_input_len} tokens.")
        max_new = item.sampling.max_new_tokens
        if item.max_new_tokens_given and self.context_len and max_new + n > self.context_len:
            raise RequestError(
                f"Requested token count exceeds the model's maximum context length of {self.context_len} tokens. "
                f"You requested a total of {max_new + n} tokens: {n} tokens from the input messages and "
                f"{max_new} tokens for the completion. Please reduce the number of tokens in the input messages "
                f"or the completion to fit within the limit.")
        if item.return_logprob and item.logprob_start_len >= n:
            raise RequestError(f"logprob_start_len ({item.logprob_start_len}) is not below the prompt length ({n}).")
        sched = self.server_args.scheduler
        if (sched.disaggregation_mode != "null" and sched.disaggregation_transfer_backend != "fake"
                and (item.bootstrap is None or item.bootstrap.room is None)):
            raise RequestError("Disaggregated request received without bootstrap room id")

    def prepare(self, items: list[GenerateItem]) -> list[list[int]]:
        """Tokenize and validate every item before any is sent (all-or-nothing per HTTP call)."""
        if self.shutting_down:
            raise RequestError("The server is shutting down.", 503)
        prepared = []
        if len({item.rid for item in items}) != len(items):
            raise RequestError("Duplicate request ids in one batch.")
        for item in items:
            if item.rid in self._states:
                raise RequestError(f"Duplicate request id {item.rid!r} is already running.")
            ids = self.tokenize(item)
            self.validate(item, ids)
            prepared.append(ids)
        return prepared

    def submit(self, item: GenerateItem, input_ids: list[int]) -> ReqState:
        out = RequestOutputState(item.rid, self.tokenizer, item.return_logprob, item.return_text_in_logprobs,
                                 item.top_logprobs_num, item.token_ids_logprob)
        state = ReqState(item=item, out=out, input_ids=input_ids)
        self._states[item.rid] = state
        self._send.put(TokenizedGenerateReq(
            rid=item.rid, input_ids=input_ids, sampling=item.sampling, return_logprob=item.return_logprob,
            logprob_start_len=item.logprob_start_len, top_logprobs_num=item.top_logprobs_num,
            token_ids_logprob=item.token_ids_logprob, stream=True, bootstrap=item.bootstrap))
        return state

    async def wait(self, state: ReqState, stream: bool, is_disconnected=None):
        """Yield cumulative snapshots (every update if `stream`, else only the final one).

        Raises RequestError for an abort carrying status >= 400. Always releases the rid; an
        unfinished request (client gone, task cancelled) is aborted in the scheduler."""
        rid = state.item.rid
        last_check = time.monotonic()
        try:
            while True:
                try:
                    await asyncio.wait_for(state.event.wait(), timeout=_DISCONNECT_POLL)
                    updated = True
                except asyncio.TimeoutError:
                    updated = False
                # NOTE: poll on a clock, not only on timeouts: a busy request never times out.
                if is_disconnected is not None and time.monotonic() - last_check >= _DISCONNECT_POLL:
                    last_check = time.monotonic()
                    if await is_disconnected():
                        logger.info("client disconnected; aborting %s", rid)
                        return
                if not updated:
                    continue
                state.event.clear()
                finish = state.out.finish_reason
                if finish is not None and finish.get("type") == "abort" and (finish.get("status_code") or 0) >= 400:
                    raise RequestError(finish.get("message") or "aborted", int(finish["status_code"]))
                if finish is not None:
                    yield self.snapshot(state)
                    return
                if stream:
                    yield self.snapshot(state)
        finally:
            self._states.pop(rid, None)
            if not state.out.finished:
                self._send.put(AbortReq(rid=rid))

    def snapshot(self, state: ReqState) -> dict:
        e2e = time.perf_counter() - state.created if state.out.finished else None
        result = state.out.to_dict(e2e)
        if self.tokenizer is None or self.server_args.skip_tokenizer_init:
            result.pop("text", None)
        return result

    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        self._send.put(AbortReq(rid=rid, abort_all=abort_all))

    # ------------------------------------------------------------ round trips
    async def _round_trip(self, waiters: list, request, timeout: float):
        fut = asyncio.get_running_loop().create_future()
        waiters.append(fut)
        self._send.put(request)
        return await asyncio.wait_for(fut, timeout)

    async def get_internal_state(self, timeout: float = 10.0) -> InternalState:
        return await self._round_trip(self._state_waiters, GetInternalStateReq(), timeout)

    async def flush_cache(self, timeout: float = 10.0) -> FlushCacheResult:
        return await self._round_trip(self._flush_waiters, FlushCacheReq(), timeout)

    async def set_kv_link(self, rate_gbps: float, latency_ms: float, stream: str | None = None,
                          timeout: float = 10.0) -> SetKVLinkResult:
        return await self._round_trip(self._link_waiters, SetKVLinkReq(rate_gbps, latency_ms, stream), timeout)

    async def health_generate(self, timeout: float = HEALTH_CHECK_TIMEOUT) -> bool:
        """A 1-token generation; healthy if the scheduler sends anything back in time."""
        if self.shutting_down:
            return False
        start = time.perf_counter()
        pd = self.server_args.scheduler.disaggregation_mode != "null"
        item = GenerateItem(rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", text=None, input_ids=[0],
                            sampling=SamplingParams(max_new_tokens=1, temperature=1.0, top_k=1),
                            max_new_tokens_given=True,  # PD: no peer, compute here (SGLang's 2.2.2.2)
                            bootstrap=BootstrapInfo("2.2.2.2", None, 0) if pd else None)
        state = self.submit(item, [0])
        try:
            while time.perf_counter() - start < timeout:
                if state.event.is_set() or self.last_receive_time > start:
                    return True
                try:
                    await asyncio.wait_for(state.event.wait(), timeout=0.25)
                except asyncio.TimeoutError:
                    pass
            return False
        finally:
            self._states.pop(item.rid, None)
            if not state.out.finished:
                self._send.put(AbortReq(rid=item.rid))

    @property
    def num_active(self) -> int:
        return len(self._states)
