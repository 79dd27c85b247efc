"""Table-driven decode for byte-level BPE tokenizers (GPT-2 style: SmolLM2, Llama-3, Qwen2).

The `tokenizers` ByteLevel decoder maps every char of every token back to one byte (the GPT-2
bytes<->unicode table), joins the bytes of all tokens and decodes them as lossy UTF-8. A token
with a char outside the table (an added token's content) contributes its own UTF-8 bytes. So a
per-id bytes table built once makes decode a join plus one `bytes.decode`: 256 x 128 ids took
~3 ms against ~8-15 ms through the Rust call on the CPU box (~30-60 us per 128 ids), a cost
the offline Engine pays for every finished request and the incremental detokenizer twice per
streamed step.

Only a tokenizer whose backend decoder is exactly ByteLevel qualifies (`ByteLevelDecoder.of`
returns None otherwise); `test/server/test_units.py` checks the table against the backend's
decode on random ids, special tokens and split characters included.
"""
from __future__ import annotations


def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable latin-1 bytes map to themselves, the
    other 68 bytes to chars 256, 257, ... in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class ByteLevelDecoder:
    def __init__(self, token_bytes: list[bytes], special_ids: frozenset[int]):
        self._bytes = token_bytes
        self._special = special_ids

    @classmethod
    def of(cls, tokenizer) -> "ByteLevelDecoder | None":
        """The table for `tokenizer` (cached on it), or None unless its backend decodes by
        ByteLevel alone and HF adds no clean-up pass."""
        cached = getattr(tokenizer, "_sgl_byte_level_decoder", False)
        if cached is not False:
            return cached
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = None
        if (backend is not None and type(backend.decoder).__name__ == "ByteLevel"
                and not getattr(tokenizer, "clean_up_tokenization_spaces", False)):
            char_byte = _unicode_to_byte()
            size = backend.get_vocab_size(with_added_tokens=True)
            token_bytes = []
            for i in range(size):
                token = backend.id_to_token(i) or ""
                try:
                    token_bytes.append(bytes(char_byte[c] for c in token))
                except KeyError:  # a char outside the table: the token's own UTF-8 (added tokens)
                    token_bytes.append(token.encode("utf-8"))
            special = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
            decoder = cls(token_bytes, special)
        try:
            tokenizer._sgl_byte_level_decoder = decoder
        except AttributeError:
            pass
        return decoder

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        """Token ids are >= 0 (sampled ids always are); ids past the table are skipped, as the
        backend skips ids it has no token for."""
        table = self._bytes
        if skip_special_tokens and not self._special.isdisjoint(ids):
            ids = [i for i in ids if i not in self._special]
        try:
            raw = b"".join(map(table.__getitem__, ids))
        except IndexError:
            raw = b"".join([table[i] for i in ids if i < len(table)])
        return raw.decode("utf-8", "replace")
