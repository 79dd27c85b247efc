"""Loading a HF tokenizer as AutoTokenizer does, without its model-config import on every start.

AutoTokenizer.from_pretrained picks the tokenizer class from tokenizer_config.json and from the
model's config, and building that config (AutoConfig) imports the model family's transformers
modules and torch.distributed: about 3 s of CPU on a 2-core machine, paid by each of the three
processes of a server (HTTP, scheduler, detokenizer) at every start. The class it picks depends
only on the files it reads and on the transformers version, so the first load records the class
name under a key of those (sha-256 of tokenizer_config.json, config.json, tokenizer.json and the
version), and later loads call that class's from_pretrained directly, as AutoTokenizer itself
ends by doing. Only transformers' own classes are recorded (never remote code); a record that
no longer names a class falls back to AutoTokenizer.

This module imports neither torch nor the model stack: the detokenizer and the HTTP process
load their tokenizer through it without torch.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile

logger = logging.getLogger(__name__)

# the files AutoTokenizer's class choice reads (tokenizer.json: its ByteLevel check)
_KEY_FILES = ("tokenizer_config.json", "config.json", "tokenizer.json")


def _records_dir() -> str:
    from sgl_kvxfer import env

    return os.path.join(env.model_cache_root(), "_tokenizer_classes")


def class_key(tokenizer_dir: str) -> str:
    """What AutoTokenizer's class choice depends on, hashed: the files it reads (absent ones
    count as absent) and the transformers version."""
    import transformers

    h = hashlib.sha256(transformers.__version__.encode())
    for name in _KEY_FILES:
        path = os.path.join(tokenizer_dir, name)
        h.update(name.encode())
        if os.path.isfile(path):
            with open(path, "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
        else:
            h.update(b"\0absent")
    return h.hexdigest()


def _recorded_class(key: str):
    try:
        with open(os.path.join(_records_dir(), key + ".json")) as f:
            name = json.load(f)["class"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    # by name from transformers itself: tokenization_auto's lookup would import the config stack
    import transformers
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    if (isinstance(cls, type) and issubclass(cls, PreTrainedTokenizerBase) and cls.__name__ == name
            and cls.__module__.startswith("transformers.")):
        return cls
    return None


def _record_class(key: str, cls) -> None:
    if not cls.__module__.startswith("transformers."):
        return  # remote code: AutoTokenizer decides every time
    folder = _records_dir()
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"class": cls.__name__}, f)
        os.replace(tmp, os.path.join(folder, key + ".json"))  # atomic: concurrent starts agree anyway
    except OSError as e:  # a read-only home: every load takes AutoTokenizer's path
        logger.debug("cannot record the tokenizer class in %s: %s", folder, e)


def load_tokenizer(tokenizer_dir: str):
    """The tokenizer AutoTokenizer.from_pretrained(tokenizer_dir) gives (local files only)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    key = class_key(tokenizer_dir)
    cls = _recorded_class(key)
    if cls is not None:
        return cls.from_pretrained(tokenizer_dir, local_files_only=True)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    _record_class(key, type(tokenizer))
    return tokenizer
