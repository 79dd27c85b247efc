"""Detokenizer process main loop.

    scheduler --BatchTokenIDOut--> [ DetokenizerManager ] --BatchStrOut--> tokenizer manager
              --InternalState / *Result (flush, KV link, profile)---------> (forwarded as is)

Invariant: one `IncrementalDetokenizer` per live rid, created on the rid's first `ReqOutput`
and dropped on the one that carries a finish_reason, so state never outlives a request. A rid
whose ids cannot be rendered ends with a 500 abort (its state dropped); the others go on.
"""
from __future__ import annotations

import logging

from sgl_kvxfer.config import ServerArgs
from sgl_kvxfer.detokenizer.byte_level import ByteLevelDecoder
from sgl_kvxfer.detokenizer.incremental import IncrementalDetokenizer, render_finished
from sgl_kvxfer.message import BatchStrOut, BatchTokenIDOut, ReqOutput
from sgl_kvxfer.message.queue import PullQueue, PushQueue

logger = logging.getLogger(__name__)


class DetokenizerManager:
    def __init__(self, tokenizer):
        self._tokenizer = tokenizer  # None under --skip-tokenizer-init: texts stay ""
        self._states: dict[str, IncrementalDetokenizer] = {}
        if tokenizer is not None:
            ByteLevelDecoder.of(tokenizer)  # build its table now, not on the first request

    def _text(self, out: ReqOutput) -> str:
        if self._tokenizer is None:
            return ""
        det = self._states.get(out.rid)
        if det is None:
            det = IncrementalDetokenizer(self._tokenizer, out.skip_special_tokens, out.spaces_between_special_tokens)
            self._states[out.rid] = det
        text = det.append(out.new_output_ids)
        if out.finish_reason is not None:
            text = det.finish(out.finish_reason, out.no_stop_trim)
            del self._states[out.rid]
        return text

    def _texts(self, outputs: list[ReqOutput]) -> list[str]:
        """A request seen first in its finishing output (not streamed) carries all its ids:
        those render together, by batched decodes (render_finished)."""
        if self._tokenizer is None:
            return [""] * len(outputs)
        whole = [i for i, o in enumerate(outputs) if o.finish_reason is not None and o.rid not in self._states]
        skip = set(whole)
        texts = [None if i in skip else self._text_or_fail(o) for i, o in enumerate(outputs)]
        try:
            rendered = render_finished(self._tokenizer, [outputs[i] for i in whole])
        except Exception:  # noqa: BLE001 (one bad request must not fail the batch: render each alone)
            rendered = [self._text_or_fail(outputs[i]) for i in whole]
        for i, text in zip(whole, rendered):
            texts[i] = text
        return texts

    def _text_or_fail(self, out: ReqOutput) -> str:
        try:
            return self._text(out)
        except Exception as e:  # noqa: BLE001
            logger.exception("cannot detokenize %s", out.rid)
            self._states.pop(out.rid, None)
            out.finish_reason = {"type": "abort", "status_code": 500, "err_type": "InternalServerError",
                                 "message": f"Internal server error: detokenizing failed: {type(e).__name__}: {e}"}
            return ""

    def handle(self, msg):
        if isinstance(msg, BatchTokenIDOut):
            return BatchStrOut(outputs=msg.outputs, texts=self._texts(msg.outputs))
        return msg  # InternalState and the *Result replies (flush, KV link, profile) go through unchanged


def run_detokenizer_process(server_args: ServerArgs, conn) -> None:
    """`conn` is a duplex pipe: the launcher sends the scheduler's tokenizer_path (or None to
    stop), we ack {"status": "ready"|"error"}. Started together with the scheduler, so the heavy
    imports below overlap with model loading."""
    logging.basicConfig(level=server_args.log_level.upper(), format="[detokenizer] %(asctime)s %(levelname)s %(message)s")
    from sgl_kvxfer.utils.tokenizer_loading import load_tokenizer  # (torch-free)

    tokenizer_path = conn.recv()
    try:
        tokenizer = None if server_args.skip_tokenizer_init else load_tokenizer(tokenizer_path)
        manager = DetokenizerManager(tokenizer)
        recv = PullQueue(server_args.ipc_addr("detokenizer_input"), "detokenizer", bind=True)
        send = PushQueue(server_args.ipc_addr("tokenizer_input"))
    except Exception as e:  # report, do not hang the launcher
        logger.exception("detokenizer failed to start")
        conn.send({"status": "error", "error": f"{type(e).__name__}: {e}"})
        return
    conn.send({"status": "ready"})

    while True:
        msg = recv.get()
        if msg is not None:
            send.put(manager.handle(msg))
