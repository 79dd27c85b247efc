"""TokenizerManager: the HTTP process's asyncio front of the pipeline.

    HTTP handler --GenerateItem--> [tokenize, validate] --TokenizedGenerateReq--> scheduler
    detokenizer --BatchStrOut--> _handle_loop --> ReqState (cumulative) --> waiting handler

Invariants:
- `self._states` holds exactly the rids whose handler is still waiting; a handler that stops
  waiting (finish, disconnect, error) pops its rid, and if the request was unfinished it also
  sends AbortReq so the scheduler frees the request's KV (and counts it as aborted once).
- Round trips (internal state, flush, KV link, profile) are FIFO: the scheduler answers in order, so each reply
  resolves every waiter registered before it was asked.
- An error while handling one request's output fails that request (500), never the receive
  loop: every other request keeps streaming.
- Shutdown (`begin_shutdown`, then `fail_all` at the drain deadline): new requests get 503,
  waiting handlers end with a 503 error in their route's shape.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus

from sgl_kvxfer.config import ServerArgs
from sgl_kvxfer.message import (HEALTH_CHECK_RID_PREFIX, AbortReq, BatchStrOut, FlushCacheReq, FlushCacheResult,
                                GetInternalStateReq, InternalState, ProfileReq, ProfileResult, SetKVLinkReq,
                                SetKVLinkResult, TokenizedGenerateReq)
from sgl_kvxfer.message.disagg import BootstrapInfo
from sgl_kvxfer.message.queue import AsyncPullQueue, PushQueue
from sgl_kvxfer.sampling.params import SamplingParams
from sgl_kvxfer.tokenizer.generate_input import GenerateItem
from sgl_kvxfer.tokenizer.metrics import ServerMetrics
from sgl_kvxfer.tokenizer.validation import RequestError, check_lengths, check_prompt_ids
from sgl_kvxfer.tokenizer.output_state import RequestOutputState

logger = logging.getLogger(__name__)
HEALTH_CHECK_TIMEOUT = 20.0
SHUTDOWN_MESSAGE = "The server is shutting down; the request was not completed. Retry on another server."
_DISCONNECT_POLL = 2.0


@dataclass
class ReqState:
    item: GenerateItem
    out: RequestOutputState
    input_ids: list[int]
    event: asyncio.Event = field(default_factory=asyncio.Event)
    created: float = field(default_factory=time.perf_counter)
    last_token_time: float = 0.0
    released: bool = False  # its handler stopped waiting (release: exactly once)


class TokenizerManager:
    def __init__(self, server_args: ServerArgs, scheduler_info: dict, tokenizer):
        self.server_args = server_args
        self.info = scheduler_info
        self.tokenizer = tokenizer
        self.context_len = int(scheduler_info.get("context_len") or 0)
        self.max_req_input_len = int(scheduler_info.get("max_req_input_len") or self.context_len)
        self.vocab_size = int(scheduler_info.get("vocab_size") or 0)
        self.pool_tokens = int(scheduler_info.get("max_total_num_tokens") or 0)
        self.metrics = ServerMetrics()
        self.shutting_down = False
        self.last_receive_time = 0.0
        self._states: dict[str, ReqState] = {}
        self._state_waiters: list[asyncio.Future] = []
        self._flush_waiters: list[asyncio.Future] = []
        self._link_waiters: list[asyncio.Future] = []
        self._profile_waiters: list[asyncio.Future] = []
        self._profile_lock = asyncio.Lock()  # one profile round trip at a time (see `profile`)
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
            try:
                msg = await self._recv.get()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 (an undecodable message: log it, keep receiving)
                logger.exception("tokenizer manager: bad message from the detokenizer")
                continue
            self.last_receive_time = time.perf_counter()
            if isinstance(msg, BatchStrOut):
                for out, text in zip(msg.outputs, msg.texts):
                    state = self._states.get(out.rid)
                    if state is None or state.out.finished:  # gone, or already failed here
                        continue
                    try:
                        self._on_output(state, out, text)
                    except Exception as e:  # noqa: BLE001 (this request fails; the others go on)
                        logger.exception("output of %s could not be handled", out.rid)
                        self._fail(state, f"Internal server error: {type(e).__name__}: {e}", 500)
            elif isinstance(msg, InternalState):
                self._resolve(self._state_waiters, msg)
            elif isinstance(msg, FlushCacheResult):
                self._resolve(self._flush_waiters, msg)
            elif isinstance(msg, SetKVLinkResult):
                self._resolve(self._link_waiters, msg)
            elif isinstance(msg, ProfileResult):
                self._resolve(self._profile_waiters, msg)

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
            if aborted and (out.finish_reason.get("status_code") or 0) >= 500:
                self._send.put(AbortReq(rid=out.rid))  # failed downstream of the scheduler: stop it there
            self.metrics.on_finish(out.prompt_tokens, out.completion_tokens, out.cached_tokens, now - state.created, aborted)
        state.event.set()

    def _fail(self, state: ReqState, message: str, status_code: int) -> None:
        """End a waiting request with an error its handler raises (RequestError); the scheduler
        is told to abort it (its KV is freed there)."""
        if state.out.finished or state.released:
            return
        state.out.finish_reason = {"type": "abort", "message": message, "status_code": status_code,
                                   "err_type": HTTPStatus(status_code).phrase.replace(" ", "")}
        self._count_abort(state)
        self._send.put(AbortReq(rid=state.item.rid))
        state.event.set()

    def _count_abort(self, state: ReqState) -> None:
        out = state.out
        self.metrics.on_finish(len(state.input_ids), out.completion_tokens, out.cached_tokens,
                               time.perf_counter() - state.created, aborted=True)

    @staticmethod
    def _resolve(waiters: list, value) -> None:
        for fut in waiters:
            if not fut.done():
                fut.set_result(value)
        waiters.clear()

    # ------------------------------------------------------------ generation
    def tokenize(self, item: GenerateItem) -> list[int]:
        if item.input_ids is not None:
            check_prompt_ids(item.input_ids, self.vocab_size or None)
            return item.input_ids
        if self.tokenizer is None:
            raise RequestError("text input needs the tokenizer; the server runs with --skip-tokenizer-init.")
        return self.tokenizer.encode(item.text)

    def validate(self, item: GenerateItem, input_ids: list[int]) -> None:
        """The request against the model and this server (validation.check_lengths), and PD's rule."""
        check_lengths(len(input_ids), item.sampling.max_new_tokens, item.max_new_tokens_given, self.context_len,
                      self.max_req_input_len, 0, item.logprob_start_len, item.return_logprob)
        sched = self.server_args.scheduler
        if (sched.disaggregation_mode != "null" and sched.disaggregation_transfer_backend != "fake"
                and (item.bootstrap is None or item.bootstrap.room is None)):
            raise RequestError("Disaggregated request received without bootstrap room id")

    def prepare(self, items: list[GenerateItem]) -> list[list[int]]:
        """Tokenize and validate every item before any is sent (all-or-nothing per HTTP call)."""
        if self.shutting_down:
            raise RequestError(SHUTDOWN_MESSAGE, 503)
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

    def submit_all(self, items: list[GenerateItem], input_ids: list[list[int]]) -> list[ReqState]:
        return [self.submit(item, ids) for item, ids in zip(items, input_ids)]

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
            self.release(state)

    def release(self, state: ReqState) -> None:
        """The handler stopped waiting for `state` (finished, failed, client gone, task
        cancelled). Idempotent: a stream's response and its generators may both call it. An
        unfinished request is aborted in the scheduler and counted as aborted, once."""
        if state.released:
            return
        state.released = True
        self._states.pop(state.item.rid, None)
        if not state.out.finished:
            self._count_abort(state)
            self._send.put(AbortReq(rid=state.item.rid))

    def snapshot(self, state: ReqState) -> dict:
        e2e = time.perf_counter() - state.created if state.out.finished else None
        result = state.out.to_dict(e2e)
        if self.tokenizer is None or self.server_args.skip_tokenizer_init:
            result.pop("text", None)
        return result

    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        self._send.put(AbortReq(rid=rid, abort_all=abort_all))

    # ------------------------------------------------------------ shutdown
    def begin_shutdown(self) -> None:
        """Stop admitting: new requests (and /health, /ready) answer 503 from now on."""
        self.shutting_down = True

    def fail_all(self, message: str = SHUTDOWN_MESSAGE, status_code: int = 503) -> int:
        """End every waiting request with an error; returns how many there were."""
        states = [s for s in self._states.values() if not s.out.finished]
        for state in states:
            self._fail(state, message, status_code)
        return len(states)

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
                          trace: bool | None = None, last_chunk: int | None = None,
                          timeout: float = 10.0) -> SetKVLinkResult:
        return await self._round_trip(self._link_waiters, SetKVLinkReq(rate_gbps, latency_ms, stream, trace, last_chunk),
                                      timeout)

    async def profile(self, request: ProfileReq, timeout: float = 10.0) -> ProfileResult:
        """Start or stop the scheduler's torch.profiler capture (/start_profile, /stop_profile).
        NOTE: a reply resolves every waiter before it (`_resolve`), which is right for queries but
        not for commands: the lock keeps one in flight, so each caller gets its own reply."""
        async with self._profile_lock:
            return await self._round_trip(self._profile_waiters, request, timeout)

    async def health_generate(self, timeout: float = HEALTH_CHECK_TIMEOUT) -> bool:
        """Healthy if the scheduler sends anything back in time. The probe request is answered
        by the scheduler loop when it reads it (between two steps, Scheduler._add_request): a
        busy server is healthy, a dead or stuck one is not (a router must not take one long
        prefill on a loaded CPU for a dead server)."""
        if self.shutting_down:
            return False
        start = time.perf_counter()
        pd = self.server_args.scheduler.disaggregation_mode != "null"
        item = GenerateItem(rid=f"{HEALTH_CHECK_RID_PREFIX}{uuid.uuid4().hex}", text=None, input_ids=[0],
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
