"""sgl_kvxfer/fusedkv/data.py and curve.py: data folders (jsonl and token files, the tokenizer check,
the folder from a flag or the environment) and the power-law extrapolation of the retrofit curve."""
from __future__ import annotations

import math

import numpy as np
import pytest

from sgl_kvxfer.fusedkv.curve import MAX_EXTRAPOLATED_MINUTES, extrapolate, fit_power_law
from sgl_kvxfer.fusedkv.data import Tokenized, chunks, is_token_folder, prepare, resolve_data_dir


def test_jsonl_and_token_folders_give_the_same_tokens(tmp_path, tiny_model, text_data):
    raw = Tokenized(text_data, tiny_model)
    assert raw.domains("eval") == ["code", "prose"] and raw.eot_id == 0  # SmolLM2's <|endoftext|>
    meta = prepare(text_data, str(tmp_path / "tok"), tiny_model)
    assert meta["vocab_size"] == 49152 and set(meta["files"]) == {f"{d}_{s}" for d in ("code", "prose")
                                                                  for s in ("train", "calib", "eval")}
    tok = Tokenized(str(tmp_path / "tok"), tiny_model)
    for d in ("code", "prose"):
        a, b = raw.tokens(d, "train"), tok.tokens(d, "train")
        assert b.dtype == np.uint16 and np.array_equal(a, b) and a[-1] == 0


def test_token_folder_reads_without_a_tokenizer(tmp_path, tiny_model, text_data):
    """From-scratch training on a machine with no model dir: meta.json gives the vocabulary."""
    prepare(text_data, str(tmp_path / "tok"), tiny_model)
    assert is_token_folder(str(tmp_path / "tok")) and not is_token_folder(text_data)
    bare, ref = Tokenized(str(tmp_path / "tok"), None), Tokenized(str(tmp_path / "tok"), tiny_model)
    assert bare.vocab_size == ref.vocab_size == 49152 and bare.eot_id == ref.eot_id
    assert np.array_equal(bare.tokens("code", "eval"), ref.tokens("code", "eval"))
    with pytest.raises(SystemExit, match="every file must be a token file"):
        Tokenized(text_data, None)


def test_token_files_of_another_tokenizer_are_refused(tmp_path, tiny_model, text_data):
    import json

    prepare(text_data, str(tmp_path / "tok"), tiny_model)
    meta = tmp_path / "tok" / "meta.json"
    m = json.load(open(meta))
    json.dump({**m, "tokenizer_sha256": "0" * 64}, open(meta, "w"))
    with pytest.raises(SystemExit, match="another tokenizer"):
        Tokenized(str(tmp_path / "tok"), tiny_model)


def test_data_folder_from_flag_or_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("SGL_KVXFER_FUSEDKV_DATA", raising=False)
    with pytest.raises(SystemExit, match="SGL_KVXFER_FUSEDKV_DATA"):
        resolve_data_dir(None)
    monkeypatch.setenv("SGL_KVXFER_FUSEDKV_DATA", str(tmp_path))
    assert resolve_data_dir(None) == str(tmp_path)
    assert resolve_data_dir(str(tmp_path)) == str(tmp_path)  # the flag wins
    with pytest.raises(SystemExit, match="does not exist"):
        resolve_data_dir(str(tmp_path / "missing"))


def test_chunks_are_shifted_windows():
    w = chunks(np.arange(20, dtype=np.uint16), 6)
    assert w.shape == (3, 7) and w[1].tolist() == list(range(6, 13))
    with pytest.raises(ValueError):
        chunks(np.arange(3, dtype=np.uint16), 6)


def test_power_law_fit_and_the_minutes_to_a_target():
    A, alpha = 0.8, 0.5
    ts = [0.5, 1, 2, 4, 8]
    fit = fit_power_law(ts, [A * t ** -alpha for t in ts])
    assert fit == pytest.approx((A, alpha), rel=1e-9)
    teacher = {"prose": 10.0}
    curve = [{"gpu_min": t, "ppl": {"prose": 10.0 * math.exp(A * t ** -alpha)}} for t in ts]
    ex = extrapolate(curve, teacher, {"prose": 1.03})["prose"]
    want = (A / math.log(1.03)) ** (1 / alpha)
    assert ex["minutes_to_target"] == pytest.approx(want, rel=1e-6) and "met_at_min" not in ex
    # a curve that does not fall gives no extrapolation; one already under the target says so
    flat = [{"gpu_min": t, "ppl": {"prose": 20.0}} for t in ts]
    assert extrapolate(flat, teacher, {"prose": 1.03})["prose"]["minutes_to_target"] is None
    # a fit that falls too slowly puts the target out of reach, without overflowing a float
    shallow = [{"gpu_min": t, "ppl": {"prose": 10.0 * math.exp(5.0 * t ** -1e-3)}} for t in ts]
    far = extrapolate(shallow, teacher, {"prose": 1.03})["prose"]
    assert far["fit"] is not None and far["minutes_to_target"] is None
    assert far["beyond_minutes"] == MAX_EXTRAPOLATED_MINUTES
    done = curve + [{"gpu_min": 9, "ppl": {"prose": 10.1}}]
    assert extrapolate(done, teacher, {"prose": 1.03})["prose"]["met_at_min"] == 9


def test_shifted_windows_move_every_epoch():
    """ShiftedWindows: the first cut is mixed_chunks' windows; later cuts start at other seeded
    offsets, each window a contiguous run of its domain's stream; EpochBatches re-cuts once per
    epoch, reproducibly for a seed."""
    import torch

    from sgl_kvxfer.fusedkv.data import EpochBatches, ShiftedWindows, mixed_chunks

    split = {"a": np.arange(1000, 1203), "b": np.arange(5000, 5150)}  # distinct values: a token says where it sits
    src = ShiftedWindows(split, 10)
    gen = torch.Generator().manual_seed(0)
    first = src.cut(gen)
    assert torch.equal(first, mixed_chunks(split, 10))
    offsets = set()
    for _ in range(6):
        w = src.cut(gen)
        for row in w:  # contiguous, inside one domain
            assert torch.equal(row, torch.arange(int(row[0]), int(row[0]) + 11))
        offsets.add(int(w[0, 0]) - 1000)
        starts_b = {int(r[0]) for r in w if r[0] >= 5000}
        assert len({(s - 5000) % 10 for s in starts_b}) == 1  # one offset per domain and cut
    assert len(offsets) > 1 and all(0 <= o < 10 for o in offsets)

    def first_tokens(seed, steps):
        batches = EpochBatches(ShiftedWindows(split, 10), 4, seed=seed)
        return [next(batches)[:, 0].tolist() for _ in range(steps)], batches

    seen, batches = first_tokens(3, 40)  # 33 windows / 4 = 8 batches an epoch: 5 epochs
    assert seen == first_tokens(3, 40)[0]
    assert batches.epochs >= 4
    fixed = EpochBatches(mixed_chunks(split, 10), 4, seed=3)
    assert [next(fixed)[:, 0].tolist() for _ in range(8)] == seen[:8]  # the first epoch is the fixed one
    assert {t % 10 for step in seen[8:] for t in step} != {0}  # later epochs start elsewhere


def test_shift_windows_is_validated():
    from sgl_kvxfer.fusedkv.data import ShiftedWindows
    from sgl_kvxfer.fusedkv.retrofit import RetrofitConfig

    with pytest.raises(ValueError, match="max_train_windows"):
        RetrofitConfig(shift_windows=True, max_train_windows=8)
    with pytest.raises(ValueError, match="two windows"):
        ShiftedWindows({"a": np.arange(15)}, 10)
