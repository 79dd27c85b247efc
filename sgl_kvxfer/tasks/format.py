"""Examples as token ids under a model's chat template (HF tokenizers; no torch).

The prompt is the user turn and the answer the assistant turn, so serving a request with the
same chat template reproduces the training format exactly. Tokenizers without a chat
template get "PROMPT\\nAnswer: " and the answer after it.
"""
from __future__ import annotations

from sgl_kvxfer.tasks.base import Example

PLAIN_SEP = "\nAnswer: "


def chat_text(tokenizer, example: Example) -> str:
    """The prompt as text, ending where the answer starts."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": example.prompt()}], tokenize=False,
                                             add_generation_prompt=True)
    return example.prompt() + PLAIN_SEP


def chat_prompt_ids(tokenizer, example: Example) -> list[int]:
    return tokenizer(chat_text(tokenizer, example), add_special_tokens=False)["input_ids"]


def train_ids(tokenizer, example: Example) -> tuple[list[int], int]:
    """(prompt + answer + end-of-turn ids, number of prompt ids): the loss covers ids[n:]."""
    prompt = chat_prompt_ids(tokenizer, example)
    answer = tokenizer(example.answer, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    return prompt + answer + ([eos] if eos is not None else []), len(prompt)
