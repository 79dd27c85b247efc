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
"""
from __future__ import annotations

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

    @property
    def output_ids(self) -> list[int]:
        return self._ids

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
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
        matched = (finish_reason or {}).get("matched") if (finish_reason or {}).get("type") == "stop" else None
        if isinstance(matched, int) and not no_stop_trim and self._ids and self._ids[-1] == matched:
            # A stop *token* is kept in output_ids but never rendered into the text.
            body = self._ids[:-1]
            return self._render_all(body)
        if self._read < len(self._ids):
            window = self._decode(self._ids[self._prefix:])
            context = self._decode(self._ids[self._prefix:self._read])
            self._text += window[len(context):]
            self._read = len(self._ids)
        if isinstance(matched, str) and matched and not no_stop_trim:
            pos = self._text.find(matched)
            if pos != -1:
                return self._text[:pos]
        return self._text

    def _render_all(self, ids: list[int]) -> str:
        # NOTE: only reached once, at finish; re-renders through the same windowed path so the
        # result is a prefix-consistent version of what was streamed.
        det = IncrementalDetokenizer(self._tokenizer, self._skip_special_tokens, self._spaces_between_special_tokens)
        det.append(ids)
        return det.finish(None, True)
