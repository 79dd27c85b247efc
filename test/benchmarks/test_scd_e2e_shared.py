"""benchmarks/pd/scd_e2e.py's shared-document scenario: which prompts go where.

The servers are replaced by fakes that record each request's ids, so the test runs in a second:
what is checked is the scenario's design (SCD requests reuse the producer's cached document; every
oracle request brings a document the specialist has never seen, or its radix cache would turn the
oracle into a question-only prefill), not any measurement.
"""
from __future__ import annotations

import types

import pytest


@pytest.fixture
def scd_e2e(load_benchmark):
    return load_benchmark("pd/scd_e2e.py")


def test_shared_oracle_prefills_a_new_document_every_time(scd_e2e, monkeypatch):
    scd_prompts, oracle_prompts = [], []
    monkeypatch.setattr(scd_e2e, "scd_request", lambda p, cons, ids, timeout: scd_prompts.append(ids) or [(0.1, 0.0)])
    monkeypatch.setattr(scd_e2e, "oracle_request", lambda cons, ids, timeout: oracle_prompts.append(ids) or 0.2)
    monkeypatch.setattr(scd_e2e, "row", lambda runs: {"n": len(runs)})
    posted = types.SimpleNamespace(raise_for_status=lambda: None)
    monkeypatch.setattr(scd_e2e.requests, "post", lambda *a, **k: posted)
    args = types.SimpleNamespace(prompt_tokens=[256], question_tokens=16, vocab=32000, timeout_s=5.0,
                                 rates=[200.0, 0.0], repeats=3)
    res = {"shared": {}}
    scd_e2e.run_shared(args, {"h": types.SimpleNamespace(url="http://producer")}, object(), res)

    doc_len = 256 - 16
    docs = {tuple(ids[:doc_len]) for ids in scd_prompts}
    assert len(docs) == 1 and all(len(ids) == 256 for ids in scd_prompts)  # one cached document
    assert len(scd_prompts) == 2 + 2 * 3  # first + warm, then repeats per rate
    assert len({tuple(ids[doc_len:]) for ids in scd_prompts}) == len(scd_prompts)  # new questions
    oracle_docs = [tuple(ids[:doc_len]) for ids in oracle_prompts]
    assert len(oracle_prompts) == 1 + 3 and all(len(ids) == 256 for ids in oracle_prompts)
    assert len(set(oracle_docs)) == len(oracle_docs)  # never a document the specialist saw
    assert not docs & set(oracle_docs)
    assert res["shared"]["256"]["oracle"] == {"n": 3}
