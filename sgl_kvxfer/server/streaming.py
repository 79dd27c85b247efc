"""Fan-in of per-request snapshot streams: SSE for `stream: true`, a list otherwise.

A batch (or n>1) in stream mode interleaves chunks from all items, each tagged `"index": i`.
Every stream ends with `data: [DONE]`; a request that fails after the stream started (an abort
with a status, a shutdown, a bug) first gets one error event in the route's shape.
NOTE: cancellation (client disconnect) must reach every per-item `TokenizerManager.wait`
generator; their `finally` blocks abort the unfinished requests and free their KV.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import time

from fastapi.responses import StreamingResponse

from sgl_kvxfer.disagg.trace import with_emit
from sgl_kvxfer.server.errors import internal_error_message, stream_error_event
from sgl_kvxfer.tokenizer.validation import RequestError

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"


class SSEResponse(StreamingResponse):
    """An SSE stream that releases its requests however it ends.

    NOTE: when the client goes away while the response is writing, Starlette cancels it with
    the body's generators suspended at a `yield`; their `finally` blocks then run only when
    they are garbage collected (maybe never, if a traceback cycle holds them). The requests
    are released here instead, synchronously, so each is aborted and counted exactly once."""

    def __init__(self, content, tm, states):
        super().__init__(content, media_type="text/event-stream")
        self._release = lambda: [tm.release(s) for s in states]

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


def _finite(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, list):
        return [_finite(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    return obj


def dumps(obj) -> bytes:
    """Strict JSON: non-finite floats (e.g. -inf logprobs) become null, as orjson does."""
    try:
        return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    except ValueError:
        return json.dumps(_finite(obj), ensure_ascii=False, separators=(",", ":")).encode()


def sse(obj) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


async def _final(tm, state, is_disconnected):
    result = None
    async for snapshot in tm.wait(state, False, is_disconnected):
        result = snapshot
    return result


async def collect(tm, states, is_disconnected=None) -> list:
    """Final snapshots in order (None for an item whose client went away)."""
    tasks = [asyncio.ensure_future(_final(tm, s, is_disconnected)) for s in states]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()


async def iter_snapshots(tm, states):
    """Yield (index, snapshot) as they come, from all items at once."""
    if len(states) == 1:
        async for snapshot in tm.wait(states[0], True):
            yield 0, snapshot
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, state):
        try:
            async for snapshot in tm.wait(state, True):
                await queue.put((i, snapshot, None))
        except Exception as e:  # noqa: BLE001 (re-raised by the consumer below)
            await queue.put((i, None, e))
        finally:
            await queue.put((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(states)]
    try:
        live = len(tasks)
        while live:
            i, snapshot, error = await queue.get()
            if error is not None:
                raise error
            if snapshot is None:
                live -= 1
                continue
            yield i, snapshot
    finally:
        for t in tasks:
            t.cancel()


async def sse_merge(tm, states, is_batch: bool, extra=None):
    written: dict[int, float] = {}  # item -> when its first chunk was written (the PD trace's d.emit)
    try:
        async for i, snapshot in iter_snapshots(tm, states):
            if i in written:
                snapshot = with_emit(snapshot, written[i])
            if is_batch:
                snapshot["index"] = i
            if extra is not None:
                snapshot.update(extra(i))
            yield sse(snapshot)
            # the response resumes this generator once the chunk's bytes went to the transport
            written.setdefault(i, time.time())
    except RequestError as e:
        yield stream_error_event(str(e), e.status_code)
    except Exception as e:  # noqa: BLE001 (a bug must still end the stream in the route's error shape)
        logger.exception("stream failed")
        yield stream_error_event(internal_error_message(e), 500)
    yield DONE
