"""OpenAI reply, choice, logprob and stream-chunk shapes built from cumulative snapshots
(`{"text","output_ids","meta_info"}` as `RequestOutputState.to_dict` gives them)."""
from __future__ import annotations


def finish_fields(meta: dict) -> tuple[str | None, object]:
    """(finish_reason string, matched_stop) from SGLang's finish dict."""
    fr = meta.get("finish_reason")
    if fr is None:
        return None, None
    kind = fr.get("type")
    return kind, (fr.get("matched") if kind == "stop" else None)


def usage(results: list[dict], n: int) -> dict:
    prompt = sum(r["meta_info"]["prompt_tokens"] for i, r in enumerate(results) if i % n == 0)
    completion = sum(r["meta_info"]["completion_tokens"] for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": None, "reasoning_tokens": 0, "completion_tokens_details": None}


def chat_logprobs(entries: list, tops: list | None) -> dict:
    content = []
    for k, (logprob, _tid, text) in enumerate(entries):
        text = text or ""
        item = {"token": text, "bytes": list(text.encode()), "logprob": logprob, "top_logprobs": []}
        if tops and k < len(tops) and tops[k]:
            item["top_logprobs"] = [{"token": t or "", "bytes": list((t or "").encode()), "logprob": lp}
                                    for lp, _i, t in tops[k]]
        content.append(item)
    return {"content": content}


def completion_logprobs(entries: list, tops: list | None, offset: int) -> dict:
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for k, (logprob, _tid, text) in enumerate(entries):
        text = text or ""
        tokens.append(text)
        token_logprobs.append(logprob)
        offsets.append(offset)
        offset += len(text)
        top = tops[k] if tops and k < len(tops) else None
        top_logprobs.append({t or "": lp for lp, _i, t in top} if top else None)
    return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": top_logprobs}


def chat_choice(i: int, snap: dict, with_logprobs: bool) -> dict:
    meta = snap["meta_info"]
    reason, matched = finish_fields(meta)
    lp = None
    if with_logprobs:
        lp = chat_logprobs(meta.get("output_token_logprobs", []), meta.get("output_top_logprobs"))
    return {"index": i, "message": {"role": "assistant", "content": snap.get("text", ""), "reasoning_content": None,
                                    "tool_calls": None}, "logprobs": lp, "finish_reason": reason, "matched_stop": matched}


def completion_choice(i: int, snap: dict, echo: str, with_logprobs: bool) -> dict:
    meta = snap["meta_info"]
    reason, matched = finish_fields(meta)
    lp = None
    if with_logprobs:
        lp = completion_logprobs(meta.get("output_token_logprobs", []), meta.get("output_top_logprobs"), len(echo))
    return {"index": i, "text": echo + snap.get("text", ""), "logprobs": lp, "finish_reason": reason,
            "matched_stop": matched}


class ChoiceStreamer:
    """Turns cumulative snapshots into per-choice delta chunks.

    Invariant: `_sent[i]` is the length of choice i's text already sent and `_lp[i]` the number of
    its logprob entries already sent; a snapshot never re-sends either. A stop-trimmed final text
    that is shorter than what was sent yields an empty delta."""

    def __init__(self, render):
        self.render = render
        self._sent: dict[int, int] = {}
        self._lp: dict[int, int] = {}
        self._echoed: set[int] = set()

    def chunks(self, i: int, snap: dict) -> list[dict]:
        r, meta = self.render, snap["meta_info"]
        text = snap.get("text", "")
        start = self._sent.get(i, 0)
        delta = text[start:]
        self._sent[i] = max(start, len(text))
        reason, matched = finish_fields(meta)
        lp = None
        if r.req.logprobs:
            done = self._lp.get(i, 0)
            entries = meta.get("output_token_logprobs", [])
            tops = meta.get("output_top_logprobs")
            self._lp[i] = len(entries)
            tops_new = tops[done:] if tops else None
            if r.kind == "chat":
                lp = chat_logprobs(entries[done:], tops_new)
            else:
                lp = completion_logprobs(entries[done:], tops_new, start)
        if r.kind == "chat":
            out = []
            if delta or lp:
                out.append(r.envelope([{"index": i, "delta": {"reasoning_content": None, "content": delta},
                                        "logprobs": lp, "finish_reason": None, "matched_stop": None}], chunk=True))
            if reason is not None:
                out.append(r.envelope([{"index": i, "delta": {"reasoning_content": None}, "logprobs": None,
                                        "finish_reason": reason, "matched_stop": matched}], chunk=True))
            return out
        if r.req.echo and i not in self._echoed:
            self._echoed.add(i)
            delta = r.prompt_texts[i // r.req.n] + delta
        if not delta and reason is None and not lp:
            return []
        return [r.envelope([{"index": i, "text": delta, "logprobs": lp, "finish_reason": reason,
                             "matched_stop": matched}], chunk=True)]
