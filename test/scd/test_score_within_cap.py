"""score_within_cap: a finished eval's per-item scores averaged over the items whose gold answer
(with its end of turn) fits a generation cap, no models run."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "quality"))


def test_rescore_keeps_only_the_fitting_items_of_the_task(tmp_path, smollm2_path):
    import score_within_cap
    from sgl_kvxfer import tasks
    from sgl_kvxfer.models.loader import load_tokenizer

    tok = load_tokenizer(smollm2_path)
    n, seed = 12, 0
    lengths = [len(tok.encode(ex.answer, add_special_tokens=False)) + 1  # + the end of turn
               for ex in tasks.generate("code", "eval", n, seed, tokenizer=tok)]
    cap = sorted(lengths)[n // 2]  # some fit, some do not
    fits = [length <= cap for length in lengths]
    assert 0 < sum(fits) < n
    # a consumer scored on qa then code (n items each): method "a" passes exactly the code items
    # that do not fit, "b" every item; qa's items must not count
    result = {"params": {"n": n, "seed": seed}, "consumer_tasks": {"c": ["qa", "code"], "other": ["qa"]},
              "results": {"c": {"a": {"item_scores": [1.0] * n + [0.0 if f else 1.0 for f in fits]},
                                "b": {"item_scores": [1.0] * (2 * n)}},
                          "other": {"a": {"item_scores": [1.0] * n}}}}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result))
    out = tmp_path / "o.json"
    got = score_within_cap.main([str(path), "--task", "code", "--cap", str(cap), "--out", str(out)])
    assert set(got) == {"c"}  # "other" has no code items
    assert got["c"]["items"] == sum(fits) and got["c"]["of"] == n
    assert got["c"]["methods"] == {"a": 0.0, "b": 1.0}
    assert json.loads(out.read_text())["consumers"]["c"]["items"] == sum(fits)
    with pytest.raises(SystemExit):
        score_within_cap.main([str(path), "--task", "kv", "--cap", str(cap)])
