"""sgl_kvxfer/fusedkv/teacher_text.py: sampled documents land as {domain}-teacher train token files
beside the corpus (tokens per domain, prompts from that domain's text, every document closed by
end-of-text), the retrofit's loader reads them with the corpus, and bad folders are refused."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from sgl_kvxfer.fusedkv.data import Tokenized, prepare
from sgl_kvxfer.fusedkv.teacher_text import _prompts, main


@pytest.fixture
def token_folder(tmp_path, tiny_model, text_data):
    prepare(text_data, str(tmp_path / "tok"), tiny_model)
    return str(tmp_path / "tok")


def test_teacher_text_adds_train_domains(token_folder, tiny_model, capsys):
    rec = main(["--model", tiny_model, "--data", token_folder, "--tokens", "300", "--prompt-tokens", "8",
                "--new-tokens", "12", "--batch", "4", "--device", "cpu", "--dtype", "float32", "--no-progress"])
    assert set(rec["files"]) == {"code-teacher_train", "prose-teacher_train"}
    data = Tokenized(token_folder, tiny_model)
    assert data.domains("train") == ["code", "code-teacher", "prose", "prose-teacher"]
    assert data.domains("eval") == ["code", "prose"] and data.domains("calib") == ["code", "prose"]
    for d in ("code", "prose"):
        got = data.tokens(f"{d}-teacher", "train")
        assert got.size >= 150 and got.size == rec["files"][f"{d}-teacher_train"]["tokens"]
        assert got[-1] == data.eot_id
        docs = np.split(got, np.flatnonzero(got == data.eot_id)[:-1] + 1)
        corpus = data.tokens(d, "train").tolist()
        for doc in docs:  # a prompt of <= 8 tokens of that domain's text, then <= 12 sampled, then eot
            assert 2 <= doc.size <= 21 and np.count_nonzero(doc == data.eot_id) == 1
            assert doc[0] in set(corpus)
    meta = json.load(open(os.path.join(token_folder, "meta.json")))
    assert meta["teacher_text"]["seconds"] > 0 and meta["files"]["prose-teacher_train"]["tokens"] > 0
    assert "wrote" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--force"):  # no silent replacement
        main(["--model", tiny_model, "--data", token_folder, "--tokens", "10", "--device", "cpu", "--no-progress"])


def test_teacher_text_needs_a_token_folder(tiny_model, text_data):
    with pytest.raises(SystemExit, match="not a token folder"):
        main(["--model", tiny_model, "--data", text_data, "--tokens", "10", "--device", "cpu", "--no-progress"])


def test_prompts_stay_inside_one_document():
    eot = 0
    corpus = np.array([5, 6, 7, 0, 8, 9, 10, 11, 12, 0, 13, 14, 0, 15, 16, 17, 18, 19, 20, 0], dtype=np.uint16)
    text = "," + ",".join(map(str, corpus.tolist())) + ","
    for seed in range(20):
        ps = _prompts(corpus, 6, 4, eot, np.random.default_rng(seed))
        assert len(ps) == 6
        for p in ps:  # a contiguous run of one document: no eot, found in the corpus as is
            assert 1 <= len(p) <= 4 and eot not in p and "," + ",".join(map(str, p)) + "," in text


def test_time_budget_stops_sampling_and_keeps_what_it_has(token_folder, tiny_model):
    rec = main(["--model", tiny_model, "--data", token_folder, "--tokens", "10000000", "--prompt-tokens", "8",
                "--new-tokens", "12", "--batch", "4", "--device", "cpu", "--dtype", "float32", "--no-progress",
                "--time-budget-s", "0.01"])
    for name in ("code-teacher_train", "prose-teacher_train"):  # one engine call per domain, then stop
        f = rec["files"][name]
        assert 0 < f["tokens"] <= 4 * 21 and f["short_of_target"]
    with pytest.raises(SystemExit):
        main(["--model", tiny_model, "--data", token_folder, "--tokens", "10", "--force", "--time-budget-s", "-1"])
