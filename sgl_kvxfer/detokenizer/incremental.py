"""Incremental detokenization of one request's output ids.

Pure Python over a HF tokenizer (no asyncio, no zmq): the detokenizer process and the offline
`Engine` both use it.

Decoding ids one by one breaks multi-token characters and word-boundary spacing, so each step
decodes a short window that starts a little before the newest ids:

    ids:   [ ........ confirmed ........ | context | new ids ... ]
                                         ^prefix   ^read
    text = confirmed text + (decode(ids[prefix:]) - decode(ids[prefix:read]))

Invariant: `self._text` only ever grows while streaming (a held-back tail never shrinks it);
`finish` may shorten it once, to trim a matched stop string.

A request whose ids arrive all at once with its finish (not streamed) renders as one full decode
of those ids, so `render_finished` renders many such requests together.
"""
from __future__ import annotations

from sgl_kvxfer.detokenizer.byte_level import ByteLevelDecoder

REPLACEMENT_CHAR = "\ufffd"
# Tokens of context decoded in front of the new ids, so spacing and merges render as in a
# full decode.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._spaces_between_special_tokens = spaces_between_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # ids before this index are rendered into self._text
        self._text = ""
        self._fast = ByteLevelDecoder.of(tokenizer) if spaces_between_special_tokens else None

    @property
    def output_ids(self) -> list[int]:
        return self._ids

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self._fast is not None:
            return self._fast.decode(ids, self._skip_special_tokens)
        kwargs = {"skip_special_tokens": self._skip_special_tokens}
        if not self._spaces_between_special_tokens:
            kwargs["spaces_between_special_tokens"] = False
        try:
            return self._tokenizer.decode(ids, **kwargs)
        except TypeError:  # fast tokenizers may reject spaces_between_special_tokens
            return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def append(self, new_ids: list[int]) -> str:
        """Add new ids; return the cumulative text, holding back an incomplete UTF-8 tail."""
        self._ids.extend(new_ids)
        if self._read == len(self._ids):
            return self._text
        window = self._decode(self._ids[self._prefix:])
        if window.endswith(REPLACEMENT_CHAR):
            return self._text  # the last token ends mid-character; wait for the rest
        context = self._decode(self._ids[self._prefix:self._read])
        self._text += window[len(context):]
        self._read = len(self._ids)
        self._prefix = max(self._prefix, self._read - _CONTEXT_TOKENS)
        return self._text

    def finish(self, finish_reason: dict | None, no_stop_trim: bool) -> str:
        """Flush any held-back tail and return the final text, trimmed at a matched stop."""
        matched = _matched_stop(finish_reason)
        body = _rendered_ids(self._ids, finish_reason, no_stop_trim)
        if len(body) < len(self._ids):  # a stop *token* is kept in output_ids, never rendered
            return self._render_all(body)
        if self._read < len(self._ids):
            window = self._decode(self._ids[self._prefix:])
            context = self._decode(self._ids[self._prefix:self._read])
            self._text += window[len(context):]
            self._read = len(self._ids)
        return _trim_stop_string(self._text, matched, no_stop_trim)

    def _render_all(self, ids: list[int]) -> str:
        # NOTE: only reached once, at finish; re-renders through the same windowed path so the
        # result is a prefix-consistent version of what was streamed.
        det = IncrementalDetokenizer(self._tokenizer, self._skip_special_tokens, self._spaces_between_special_tokens)
        det.append(ids)
        return det.finish(None, True)


def _matched_stop(finish_reason: dict | None):
    return (finish_reason or {}).get("matched") if (finish_reason or {}).get("type") == "stop" else None


def _trim_stop_string(text: str, matched, no_stop_trim: bool) -> str:
    if isinstance(matched, str) and matched and not no_stop_trim:
        pos = text.find(matched)
        if pos != -1:
            return text[:pos]
    return text


def _rendered_ids(ids: list[int], finish_reason: dict | None, no_stop_trim: bool) -> list[int]:
    """The ids a finished request's text shows: all, less a matched stop *token* at the end."""
    matched = _matched_stop(finish_reason)
    if isinstance(matched, int) and not no_stop_trim and ids and ids[-1] == matched:
        return ids[:-1]
    return ids


def render_finished(tokenizer, outputs) -> list[str]:
    """Final texts of finished requests whose output carries all their ids (never streamed).
    Each equals what `IncrementalDetokenizer.append(ids)` then `.finish(reason, no_stop_trim)`
    returns: one full decode of the rendered ids, then the stop-string trim. They are decoded
    per (skip_special_tokens, spaces_between_special_tokens) group: from the byte-level table
    (byte_level.py) where the tokenizer has one, else by one Rust `decode_batch` call, instead
    of one HF decode call per request.
    outputs: ReqOutput-like (new_output_ids, finish_reason, no_stop_trim and the two flags)."""
    texts: list[str] = [""] * len(outputs)
    groups: dict[tuple[bool, bool], list[int]] = {}
    for i, out in enumerate(outputs):
        groups.setdefault((out.skip_special_tokens, out.spaces_between_special_tokens), []).append(i)
    for (skip, spaces), idx in groups.items():
        bodies = [_rendered_ids(list(outputs[i].new_output_ids), outputs[i].finish_reason, outputs[i].no_stop_trim)
                  for i in idx]
        for i, text in zip(idx, _decode_batch(tokenizer, bodies, skip, spaces)):
            out = outputs[i]
            texts[i] = _trim_stop_string(text, _matched_stop(out.finish_reason), out.no_stop_trim)
    return texts


def _decode_batch(tokenizer, bodies: list[list[int]], skip_special_tokens: bool,
                  spaces_between_special_tokens: bool) -> list[str]:
    det = IncrementalDetokenizer(tokenizer, skip_special_tokens, spaces_between_special_tokens)
    if det._fast is not None:  # the byte-level table: ~3x less host time than the Rust decode
        return [det._fast.decode(ids, skip_special_tokens) for ids in bodies]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    # HF's decode is the backend's decode plus an optional clean-up pass and the
    # spaces_between_special_tokens option: batch through the backend only when neither applies.
    if (backend is not None and spaces_between_special_tokens
            and not getattr(tokenizer, "clean_up_tokenization_spaces", False)):
        return backend.decode_batch(bodies, skip_special_tokens=skip_special_tokens)
    return [det._decode(ids) for ids in bodies]
