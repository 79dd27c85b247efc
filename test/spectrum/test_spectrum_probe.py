import json
import os

import pytest
import torch

from sgl_kvxfer.spectrum import probe
from sgl_kvxfer.spectrum import niah
from sgl_kvxfer.spectrum.niah import (DEFAULT_PROSE_PATH, build_niah_prompt, build_probe_trials, load_filler_texts,
                                      needle_sentence, niah_success)
from sgl_kvxfer.spectrum.probe import (ProbeResult, int4_decision, load_cached_probe, model_fingerprint,
                                       probe_cache_dir, resolve_int4, run_int4_probe, store_probe)

FILLER = ["Alpha beta gamma delta.\nEpsilon zeta eta theta.\n" * 40, "Iota kappa lambda mu.\n" * 40]


@pytest.fixture
def trials():
    return build_probe_trials(FILLER, 3, target_tokens=300)


def answering(trials, correct):
    """Fake engine: answers trial i correctly iff correct[i]."""
    codes = {t.prompt: (t.passcode if ok else "0000000") for t, ok in zip(trials, correct)}
    calls = []

    def run_trial(prompt):
        calls.append(prompt)
        return f"The passcode is {codes[prompt]}."
    return run_trial, calls


def test_two_of_three_rule():
    assert int4_decision([True, True, False]) and int4_decision([True, True, True])
    assert not int4_decision([True, False, False]) and not int4_decision([False] * 3)


@pytest.mark.parametrize("correct,enabled", [((1, 1, 1), True), ((1, 0, 1), True), ((0, 0, 1), False), ((0, 0, 0), False)])
def test_run_probe(trials, correct, enabled):
    run_trial, calls = answering(trials, correct)
    result = run_int4_probe(run_trial, trials, "fp")
    assert result.int4_enabled is enabled and result.successes == sum(correct) and len(calls) == 3
    assert result.policy == "greedy" and result.budget == 0.3


def test_forced_modes_never_probe(tmp_path):
    def boom(_):
        raise AssertionError("must not run")
    assert resolve_int4("on", run_trial=boom, cache_dir=tmp_path).enabled
    assert not resolve_int4("off", run_trial=boom, cache_dir=tmp_path).enabled
    with pytest.raises(ValueError):
        resolve_int4("maybe")


def test_auto_probes_once_then_hits_cache(tmp_path, trials):
    run_trial, calls = answering(trials, (1, 0, 0))
    first = resolve_int4("auto", "fp-a", run_trial, trials, tmp_path)
    assert (first.enabled, first.source, len(calls)) == (False, "probe", 3)
    second = resolve_int4("auto", "fp-a", run_trial, trials, tmp_path)
    assert (second.enabled, second.source, len(calls)) == (False, "cache", 3)
    other = resolve_int4("auto", "fp-b", answering(trials, (1, 1, 0))[0], trials, tmp_path)
    assert (other.enabled, other.source) == (True, "probe")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp-a.json", "fp-b.json"]


def test_cache_env_override_and_corrupt_file(tmp_path, monkeypatch):
    monkeypatch.setenv(probe.ENV_PROBE_CACHE, str(tmp_path / "c"))
    assert probe_cache_dir() == tmp_path / "c"
    path = store_probe(ProbeResult("abc", [True, True, False], True))
    assert path.parent == tmp_path / "c" and load_cached_probe("abc").int4_enabled
    path.write_text("{not json")
    assert load_cached_probe("abc") is None
    path.write_text(json.dumps({"fingerprint": "other", "outcomes": [], "int4_enabled": True}))
    assert load_cached_probe("abc") is None
    monkeypatch.delenv(probe.ENV_PROBE_CACHE)
    assert probe_cache_dir().parts[-3:] == (".cache", "sgl_kvxfer", "int4_probe")


def test_fingerprint_is_weight_and_config_sensitive():
    g = torch.Generator().manual_seed(0)
    weights = {"w1": torch.randn(64, 32, generator=g), "w2": torch.randn(7, generator=g).to(torch.bfloat16)}
    cfg = {"hidden_size": 32, "num_layers": 2}
    fp = model_fingerprint(cfg, weights)
    assert fp == model_fingerprint(dict(reversed(cfg.items())), list(reversed(weights.items())))
    assert fp != model_fingerprint({**cfg, "num_layers": 3}, weights)
    changed = {k: v.clone() for k, v in weights.items()}
    changed["w1"][-1, -1] += 1.0                      # the last element is always sampled
    assert fp != model_fingerprint(cfg, changed)
    changed = {k: v.clone() for k, v in weights.items()}
    changed["w2"][3] += 1                             # small tensors are sampled in full
    assert fp != model_fingerprint(cfg, changed)
    assert fp != model_fingerprint(cfg, {**weights, "w3": torch.zeros(1)})
    meta = {"w": torch.empty(10, device="meta")}
    assert model_fingerprint(cfg, meta) == model_fingerprint(cfg, meta)


def test_niah_prompt_structure():
    p = build_niah_prompt(FILLER, "1234567", 0.5, target_tokens=300)
    assert p.count("1234567") == 1 and needle_sentence("1234567") in p
    assert "What is the secret passcode" in p.split("</document>")[1]
    at = p.index("1234567") / len(p)
    assert 0.35 < at < 0.65
    assert p.index("1234567") < build_niah_prompt(FILLER, "1234567", 0.9, target_tokens=300).index("1234567")
    assert len(p) <= 300 * 4 + 10
    short = build_niah_prompt(FILLER, "1234567", 0.5, target_tokens=300, count_tokens=lambda s: len(s.split()))
    assert len(short.split()) <= 300


def test_probe_trials_deterministic_and_distinct(trials):
    again = build_probe_trials(FILLER, 3, target_tokens=300)
    assert [t.prompt for t in trials] == [t.prompt for t in again]
    assert len({t.passcode for t in trials}) == 3 and [t.depth for t in trials] == [0.25, 0.5, 0.75]


def test_success_check():
    assert niah_success("7654321", "7654321")
    assert niah_success("The passcode is 7 654 321.", "7654321")
    assert niah_success("passcode: 7654321\n", "7654321")
    assert not niah_success("76543210", "7654321") and not niah_success("I don't know", "7654321")
    assert not niah_success("17654321", "7654321")


@pytest.mark.parametrize("source", ["default", "stdlib"])
def test_filler_prose_builds_probe_prompts(source, monkeypatch, tmp_path):
    """The default prose file where it exists, else (a clean clone) the stdlib's docstrings."""
    if source == "default" and not os.path.exists(DEFAULT_PROSE_PATH):
        pytest.skip(f"{DEFAULT_PROSE_PATH} absent on this machine")
    if source == "stdlib":
        monkeypatch.setattr(niah, "DEFAULT_PROSE_PATH", str(tmp_path / "absent.jsonl"))
        monkeypatch.setenv("SGL_KVXFER_PROBE_PROSE", str(tmp_path / "absent.jsonl"))
    texts = load_filler_texts()
    assert len(texts) > 10
    trials = build_probe_trials(texts)
    assert all(3500 <= len(t.prompt) / 4 <= 4096 for t in trials)


def test_filler_prose_named_file_must_exist(monkeypatch, tmp_path):
    monkeypatch.setenv("SGL_KVXFER_PROBE_PROSE", str(tmp_path / "missing.jsonl"))
    with pytest.raises(FileNotFoundError, match="SGL_KVXFER_PROBE_PROSE"):
        load_filler_texts()
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"source": "x", "text": "hello world"}) + "\n")
    monkeypatch.setenv("SGL_KVXFER_PROBE_PROSE", str(rows))
    assert load_filler_texts() == ["hello world"]
