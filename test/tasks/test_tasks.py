"""The task suite: seeded and split-disjoint, answers read from the context, exact scoring,
context length and depth as asked, bad parameters refused."""
import pytest

from sgl_kvxfer import tasks
from sgl_kvxfer.tasks.scoring import UnsafeExpression, exact_match, extract_answer, safe_eval, token_f1

ALL = ("qa", "kv", "needle", "code")


@pytest.mark.parametrize("task", ALL)
def test_seeded_and_split_disjoint(task):
    a = tasks.generate(task, "eval", 4, seed=3)
    assert a == tasks.generate(task, "eval", 4, seed=3)
    assert tasks.generate(task, "eval", 2, seed=3, start=2) == a[2:]
    others = {ex.prompt() for s in ("train", "calib") for ex in tasks.generate(task, s, 4, seed=3)}
    others |= {ex.prompt() for ex in tasks.generate(task, "eval", 4, seed=4)}
    assert not others & {ex.prompt() for ex in a}
    assert len({ex.uid for ex in a}) == 4


@pytest.mark.parametrize("task", ALL)
def test_gold_scores_one_and_wrong_scores_zero(task):
    for ex in tasks.generate(task, "calib", 20, seed=0):
        if task != "code":
            assert ex.answer in ex.context
        gold = tasks.score(ex, ex.answer)
        assert all(v == 1.0 for v in gold.values()), (ex.answer, gold)
        assert tasks.score(ex, f"Answer: {ex.answer}.\nBecause the text says so.") == gold
        assert all(v == 0.0 for v in tasks.score(ex, "I do not know").values())
        assert tasks.Example.from_dict(ex.to_dict()) == ex


def test_qa_has_a_distractor_of_the_same_attribute():
    for ex in tasks.generate("qa", "eval", 30, seed=1):
        phrase = {"founder": "was founded by", "head": "The current head of", "town": "is located in the town",
                  "year": "opened its doors in", "product": "is best known for", "workers": "workers."}
        assert ex.context.count(phrase[ex.meta["attribute"]]) >= 2


def test_code_pass_is_unit_tested_not_string_matched():
    ex = tasks.generate("code", "eval", 1, seed=0)[0]
    h, rest = ex.answer.split("(", 1)
    assert h in ex.meta["helpers"]
    spaced = ex.answer.replace(",", " ,  ")
    assert tasks.score(ex, spaced) == {"pass": 1.0, "em": 1.0}
    assert tasks.score(ex, f"({ex.answer}) + 0")["pass"] == 1.0
    assert tasks.score(ex, f"({ex.answer}) + 0")["em"] == 0.0
    assert tasks.score(ex, "__import__('os').system('true')")["pass"] == 0.0
    with pytest.raises(UnsafeExpression):
        safe_eval("x.__class__", {"x": 1})
    with pytest.raises(UnsafeExpression):
        safe_eval("10 ** 100", {})
    assert safe_eval("f(x, 2) * 3", {"x": 4}, {"f": (("a", "b"), "a - b")}) == 6


@pytest.mark.heavy  # over 10 s on 2 cores: CI leaves it out (README, Tests)
@pytest.mark.parametrize("task", tasks.task_names())
def test_generation_cap_holds_every_gold_answer(task, smollm2_path):
    """max_answer_tokens caps generation in every scorer: a gold answer longer than the cap
    (its end of turn included) could never be produced, and the task would score a method's
    truncation instead of its answer (code's once cut a third of its answers)."""
    from sgl_kvxfer.models.loader import load_tokenizer

    tok = load_tokenizer(smollm2_path)
    cap = tasks.get_task(task).max_answer_tokens
    for split in tasks.SPLITS:
        answers = [tasks.train_ids(tok, ex) for ex in tasks.generate(task, split, 400, seed=0, tokenizer=tok)]
        longest = max(len(ids) - n_prompt for ids, n_prompt in answers)
        assert longest <= cap, f"{task}/{split}: a gold answer takes {longest} tokens with its end of turn, cap {cap}"


@pytest.mark.parametrize("task,n_tokens", [("kv", 600), ("needle", 2048), ("needle", 8192)])
def test_context_tokens_with_a_tokenizer(task, n_tokens, smollm2_path):
    from sgl_kvxfer.models.loader import load_tokenizer

    tok = load_tokenizer(smollm2_path)
    for ex in tasks.generate(task, "eval", 2, seed=0, tokenizer=tok, context_tokens=n_tokens):
        got = len(tasks.chat_prompt_ids(tok, ex))
        assert 0.9 * n_tokens <= got <= 1.03 * n_tokens + 40, got


@pytest.mark.parametrize("task", ["kv", "needle"])
def test_depth(task):
    for depth in (0.0, 0.25, 0.5, 1.0):
        for ex in tasks.generate(task, "eval", 3, seed=0, context_tokens=1500, depth=depth):
            assert abs(ex.meta["depth"] - depth) < 0.02
            where = ex.context.find(ex.answer if task == "kv" or ex.meta["hops"] == 1 else "has the same")
            assert abs(where / len(ex.context) - depth) < 0.1


def test_kv_near_keys_and_long_values():
    for ex in tasks.generate("kv", "eval", 4, seed=1, context_tokens=1500, value_digits=10, near_keys=3):
        key = ex.question.split("key ")[-1].rstrip("?")
        lines = ex.context.split("\n")[2:]
        assert f"{key}: {ex.answer}" in lines and len(ex.answer) == 10 and ex.answer.isdigit()
        keys = [line.split(": ")[0] for line in lines]
        assert len(set(keys)) == len(keys)  # every key distinct, the asked one included
        near = [k for k in keys if k != key and sum(a != b for a, b in zip(k, key)) == 1 and len(k) == len(key)]
        assert len(near) == 3
    # the defaults make the same items as before the knobs existed (6 digits, no near keys)
    ex = tasks.generate("kv", "eval", 1, seed=0, context_tokens=600)[0]
    assert ex == tasks.generate("kv", "eval", 1, seed=0, context_tokens=600, value_digits=6, near_keys=0)[0]
    assert len(ex.answer) == 6


def test_kv_near_values_differ_from_the_answer_in_m_digits():
    for ex in tasks.generate("kv", "eval", 4, seed=2, context_tokens=1500, value_digits=10, near_keys=8,
                             near_values=2):
        key = ex.question.split("key ")[-1].rstrip("?")
        pairs = [line.split(": ") for line in ex.context.split("\n")[2:]]
        near = [v for k, v in pairs if k != key and sum(a != b for a, b in zip(k, key)) == 1]
        assert len(near) == 8 and [v for k, v in pairs if k == key] == [ex.answer]
        for v in near:
            assert len(v) == 10 and v[0] != "0" and sum(a != b for a, b in zip(v, ex.answer)) == 2


def test_two_hop_needle_needs_both_facts():
    ex = tasks.generate("needle", "eval", 1, seed=0, hops=2, depth=0.5)[0]
    asked = ex.question.split("of ")[-1].rstrip("?")
    assert f"{asked} has the same secret number as" in ex.context
    assert f"The secret number of {asked} is" not in ex.context
    assert ex.answer in ex.context


@pytest.mark.parametrize("task,params", [
    ("kv", {"context_tokens": 10}), ("kv", {"context_tokens": 10 ** 9}), ("kv", {"depth": 1.5}),
    ("kv", {"depth": float("nan")}),
    ("kv", {"value_digits": 3}), ("kv", {"value_digits": 13}), ("kv", {"near_keys": -1}), ("kv", {"near_keys": 17}),
    ("kv", {"near_values": 6}), ("kv", {"near_values": -1}), ("kv", {"near_values": 1.0}),
    ("kv", {"value_digits": 6.5}), ("needle", {"hops": 3}), ("qa", {"entities": 1}), ("qa", {"entities": 2.5}),
    ("code", {"helpers": "4"}), ("qa", {"colour": 1}),
])
def test_bad_parameters_are_refused(task, params):
    with pytest.raises(ValueError):
        tasks.generate(task, "eval", 1, **params)


def test_mix_and_evaluate():
    assert tasks.parse_mix("qa=2, code") == {"qa": 2.0, "code": 1.0}
    for bad in ("", "qa=0", "qa=-1", "qa=nan", "qa=inf", "qa=x"):
        with pytest.raises(ValueError):
            tasks.parse_mix(bad)
    with pytest.raises(KeyError):
        tasks.parse_mix("poetry")
    exs = tasks.generate("qa", "eval", 2) + tasks.generate("kv", "eval", 1)
    res = tasks.evaluate(exs, [exs[0].answer, "nothing", exs[2].answer])
    assert res["qa"]["n"] == 2 and res["qa"]["em"] == 0.5 and res["kv"] == {"n": 1, "em": 1.0}


def test_answer_extraction_and_squad_metrics():
    assert extract_answer('  "Tolan Brek".\nmore') == "Tolan Brek"
    assert extract_answer("Answer: 42") == "42"
    assert exact_match("The Brek Mills", "brek mills") == 1.0
    assert token_f1("Tolan", "Tolan Brek") == pytest.approx(2 / 3)


def test_cli(tmp_path, capsys):
    from sgl_kvxfer.tasks.__main__ import main

    out = tmp_path / "kv.jsonl"
    main(["generate", "--task", "kv", "--n", "3", "--param", "context_tokens=300", "--param", "depth=0.5",
          "--out", str(out)])
    exs = tasks.read_jsonl(str(out))
    assert exs == tasks.generate("kv", "eval", 3, context_tokens=300, depth=0.5)
    main(["show", "--task", "code"])
    assert "[answer]" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["generate", "--task", "kv", "--n", "1", "--param", "depth=2", "--out", str(out)])
