"""utils/tokenizer_loading.py: the recorded class gives AutoTokenizer's tokenizer, without the
model-config import (and without torch) on later loads."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from sgl_kvxfer.utils import tokenizer_loading

SAMPLES = ["Hello world", "  two  spaces\tand a tab\n", "héllo wörld 東京 🙂", "def f(x):\n    return x + 1",
           "<|im_start|>user\nhi<|im_end|>"]


@pytest.fixture()
def records(tmp_path, monkeypatch):
    monkeypatch.setenv("SGL_KVXFER_MODEL_CACHE", str(tmp_path / "models"))
    return tmp_path / "models" / "_tokenizer_classes"


def test_recorded_class_loads_what_autotokenizer_loads(smollm2_path, records):
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(smollm2_path, local_files_only=True)
    first = tokenizer_loading.load_tokenizer(smollm2_path)  # AutoTokenizer's path, then recorded
    assert [p.name for p in records.iterdir()] == [tokenizer_loading.class_key(smollm2_path) + ".json"]
    second = tokenizer_loading.load_tokenizer(smollm2_path)  # the recorded class
    for tok in (first, second):
        assert type(tok) is type(auto) and tok.get_vocab() == auto.get_vocab()
        assert tok.all_special_tokens == auto.all_special_tokens and tok.eos_token_id == auto.eos_token_id
        assert tok.chat_template == auto.chat_template
        for text in SAMPLES:
            ids = auto.encode(text)
            assert tok.encode(text) == ids
            for skip in (True, False):
                assert tok.decode(ids, skip_special_tokens=skip) == auto.decode(ids, skip_special_tokens=skip)
        chat = [{"role": "user", "content": SAMPLES[2]}]
        assert tok.apply_chat_template(chat, tokenize=False) == auto.apply_chat_template(chat, tokenize=False)


def test_the_key_follows_the_files_autotokenizer_reads(smollm2_path, tmp_path):
    copy = tmp_path / "tok"
    shutil.copytree(smollm2_path, copy, ignore=shutil.ignore_patterns("*.safetensors"))
    key = tokenizer_loading.class_key(str(copy))
    assert key == tokenizer_loading.class_key(smollm2_path)  # the content, not the folder
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    assert tokenizer_loading.class_key(str(copy)) != key
    os.remove(copy / "config.json")
    assert len({key, tokenizer_loading.class_key(str(copy))}) == 2


def test_a_record_that_names_no_class_falls_back_to_autotokenizer(smollm2_path, records):
    records.mkdir(parents=True)
    path = records / (tokenizer_loading.class_key(smollm2_path) + ".json")
    for bad in ('{"class": "NoSuchTokenizer"}', "not json", '{"class": "AutoModel"}'):
        path.write_text(bad)
        tok = tokenizer_loading.load_tokenizer(smollm2_path)
        assert tok.encode("Hello world") == [19556, 905]
        assert json.loads(path.read_text()) == {"class": type(tok).__name__}  # re-recorded


def test_a_recorded_load_imports_neither_torch_nor_the_model_config(smollm2_path, tmp_path):
    env = {**os.environ, "SGL_KVXFER_MODEL_CACHE": str(tmp_path / "models")}
    code = ("import sys; from sgl_kvxfer.utils.tokenizer_loading import load_tokenizer; "
            f"t = load_tokenizer({smollm2_path!r}); "
            "print(type(t).__name__, 'torch' in sys.modules, "
            "any(m.startswith('transformers.models.llama') for m in sys.modules))")
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    second = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    name = first.stdout.split()[0]
    assert first.stdout.split()[2] == "True"  # AutoTokenizer's path reads the model's config
    assert second.stdout.split() == [name, "False", "False"]
