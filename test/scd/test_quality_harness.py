"""SCD quality harness: the QA generator is seeded and extractive; the split-inference protocol is
exact where it must be (same model, full rank: SCD and raw reuse decode exactly as the oracle)."""
import os
import random
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "quality"))

from scd_qa import build_qa, f1  # noqa: E402


def _docs(seed):
    rng = random.Random(seed)
    words = [f"tok{i}" for i in range(500)]
    code = ["\n".join([f"name_{d}_{i} = value_{rng.randint(0, 999)}" if i % 3 == 0 else
                       " ".join(rng.choice(words) for _ in range(12)) for i in range(80)]) for d in range(6)]
    prose = ["\n".join(" ".join(rng.choice(words) for _ in range(14)) for _ in range(80)) for _ in range(6)]
    return {"code": code, "prose": prose}


def test_qa_generator_is_seeded_and_extractive():
    texts = _docs(0)
    a, b = build_qa(texts, 20, seed=1), build_qa(texts, 20, seed=1)
    assert a == b and len(a) == 40
    assert build_qa(texts, 20, seed=2) != a
    assert {it.kind for it in a if it.corpus == "code"} == {"assignment", "next-words"}
    for it in a:
        assert it.answer in it.context or it.answer in " ".join(it.context.split())
        assert it.question in it.prompt() and it.context in it.prompt()
        assert f1(it.answer, it.answer) == 1.0
    assert f1("tok1 tok2", "tok1 tok3") == pytest.approx(0.5) and f1("", "x") == 0.0
    assert f1('"value_3"\nmore text', "value_3") == 1.0  # first line, quotes stripped


def test_left_padded_batch_equals_single_rows(tiny_pair):
    from sgl_kvxfer.models.loader import load_model
    from sgl_kvxfer.scd.forward import LlamaRunner, left_pad

    model, _ = load_model(tiny_pair["a"], "auto", torch.float32, "cpu", 0)
    r = LlamaRunner(model)
    prompts = [list(range(100, 113)), list(range(300, 305))]
    batch = []
    ids, valid, pos = left_pad([p[:-1] for p in prompts])
    cache, _ = r.prefill_cache(ids, pos, valid)
    batch = r.greedy(cache, torch.tensor([p[-1] for p in prompts]), torch.tensor([len(p) - 1 for p in prompts]), 5)
    for p, got in zip(prompts, batch):
        ids, valid, pos = left_pad([p[:-1]])
        c1, _ = r.prefill_cache(ids, pos, valid)
        assert r.greedy(c1, torch.tensor([p[-1]]), torch.tensor([len(p) - 1]), 5)[0] == got
        full = r.forward(torch.tensor([p]), torch.arange(len(p))[None], torch.ones(1, len(p), dtype=torch.bool),
                         logits="last").logits
        assert int(full[0, -1].argmax()) == got[0]


@pytest.mark.slow
def test_harness_same_model_full_rank_is_exact(tiny_pair, tmp_path):
    """Consumer == producer and Reuse at full rank: every reuse-based method reproduces the
    oracle's answers and distribution (KL ~ 0); int4 stays close, DroidSpeak is exact."""
    from scd_harness import Harness
    from sgl_kvxfer.scd.calibrate import calibrate, parse_args
    from test_calibrate import synthetic_calib

    out = str(tmp_path / "art")
    calibrate(parse_args(["--producer", tiny_pair["producer"], "--consumer", f"self={tiny_pair['producer']}",
                          "--calib", *synthetic_calib(tmp_path), "--r-k", "16", "--r-v", "16", "--ridge", "1e-9",
                          "--patch-budget", "0", "--out", out, "--prefix-len", "48", "--num-prefixes", "8",
                          "--batch-size", "4", "--select-prompts", "2", "--select-prefix", "12", "--select-cont", "4",
                          "--device", "cpu", "--save-stats", "--code-dtype", "float32"]))
    h = Harness(out, tiny_pair["producer"], {}, "cpu", torch.float32, droid_k=2)
    prompts = [list(range(700, 721)), list(range(900, 911))]
    ans = h.answer(prompts, h.methods, 4, batch=2)
    assert set(h.methods) == {"oracle", "raw", "int4", "reuse", "droidspeak", "scd"}
    for meth in ("raw", "reuse", "droidspeak", "scd"):
        assert ans[("self", meth)] == ans[("self", "oracle")], meth
    windows = [list(range(1000, 1040)), list(range(2000, 2040))]
    acc = h.score(windows, 30, h.methods, batch=2)
    for meth in ("raw", "scd", "reuse", "droidspeak"):
        assert acc[("self", meth)]["kl_sum"] / acc[("self", meth)]["tokens"] < 1e-5, meth
    assert 0 < acc[("self", "int4")]["kl_sum"] / acc[("self", "int4")]["tokens"] < 0.5
    bpt = h.bytes_per_token()
    assert bpt["raw"] == 4 * 2 * 2 * 16 * 2 and bpt["int4"] < bpt["raw"] / 2
