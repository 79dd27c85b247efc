"""Shared set-up for the example programs: one RuntimeEndpoint per URL, ChatML template
(SmolLM2's format; SGLang cannot guess it from a local path)."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import sglang as sgl  # noqa: E402

DEFAULT_URL = "http://127.0.0.1:30000"


def connect(url: str, chat_template: str = "chatml"):
    backend = sgl.RuntimeEndpoint(url, chat_template_name=chat_template)
    sgl.set_default_backend(backend)
    return backend
