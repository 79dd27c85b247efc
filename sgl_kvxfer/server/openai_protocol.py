"""OpenAI request schemas (pydantic). Unknown keys are accepted and ignored, as in SGLang; type
errors become 400 ErrorResponse objects (see errors.py)."""
from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Open):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _SamplingFields(_Open):
    """Fields both routes share, including SGLang's extras."""
    model: str = "default"
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    no_stop_trim: bool | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    rid: str | list[str] | None = None
    user: str | None = None

    @field_validator("n")
    @classmethod
    def _n_positive(cls, v):
        if v < 1:
            raise ValueError("n must be >= 1")
        return v


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens_positive(cls, v):
        if v is not None and v <= 0:
            raise ValueError("max_tokens must be above 0")
        return v

    @field_validator("logprobs")
    @classmethod
    def _logprobs_range(cls, v):
        if v is not None and not 0 <= v <= 20:
            raise ValueError("logprobs must be in [0, 20]")
        return v


class ContentPart(_Open):
    type: str
    text: str | None = None


class ChatMessage(_Open):
    role: Literal["system", "user", "assistant", "tool", "developer", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text":
                raise ValueError(f"content part type {part.type!r} is not supported by this text-only model")
            parts.append(part.text or "")
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    response_format: dict | None = None

    @field_validator("max_tokens", "max_completion_tokens")
    @classmethod
    def _max_positive(cls, v):
        if v is not None and v <= 0:
            raise ValueError("max_tokens must be above 0")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_range(cls, v):
        if v is not None and not 0 <= v <= 20:
            raise ValueError("top_logprobs must be in [0, 20]")
        return v


def sampling_dict(req: _SamplingFields, max_new_tokens: int | None) -> dict:
    """The request's sampling knobs in SGLang `sampling_params` form (None = default)."""
    return {
        "max_new_tokens": max_new_tokens, "min_new_tokens": req.min_tokens, "temperature": req.temperature,
        "top_p": req.top_p, "top_k": req.top_k, "min_p": req.min_p, "frequency_penalty": req.frequency_penalty,
        "presence_penalty": req.presence_penalty, "repetition_penalty": req.repetition_penalty,
        "stop": req.stop, "stop_token_ids": req.stop_token_ids, "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens, "no_stop_trim": req.no_stop_trim,
        "spaces_between_special_tokens": req.spaces_between_special_tokens, "logit_bias": req.logit_bias,
        "sampling_seed": req.seed, "regex": req.regex, "json_schema": req.json_schema, "ebnf": req.ebnf,
    }
