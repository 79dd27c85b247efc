"""SCD quality harness: the split-inference protocol is exact where it must be (same model, full
rank: SCD, Reuse-only and raw reuse decode and score exactly as the oracle), and the rank
levels' codes are what the table and the adaptive sweep read."""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "quality"))


def test_left_padded_batch_equals_single_rows(tiny_pair):
    from sgl_kvxfer.models.loader import load_model
    from sgl_kvxfer.scd.calib.forward import LlamaRunner, left_pad

    model, _ = load_model(tiny_pair["a"], "auto", torch.float32, "cpu", 0)
    r = LlamaRunner(model)
    prompts = [list(range(100, 113)), list(range(300, 305))]
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
def test_harness_same_model_full_rank_is_exact(tiny_pair, tmp_path, smollm2_path):
    """Consumer == producer and Reuse at full rank: every reuse-based method reproduces the
    oracle's answers and distribution (KL ~ 0, top-1 agreement 1); int8 / int4 stay close; the
    lower rank levels are scored and cost fewer bytes."""
    from scd_harness import Harness
    from sgl_kvxfer import tasks
    from sgl_kvxfer.scd.calib.calibrate import calibrate, parse_args

    out = str(tmp_path / "art")
    calibrate(parse_args(["--producer", tiny_pair["producer"], "--consumer", f"self={tiny_pair['producer']}",
                          "--calib", "task:qa", "--r-k", "16", "--r-v", "16", "--rank-levels", "4:4,8:8",
                          "--ridge", "1e-9", "--patch-budget", "0", "--out", out, "--num-prefixes", "16",
                          "--batch-size", "8", "--select-prompts", "2", "--device", "cpu", "--save-stats",
                          "--code-dtype", "float32"]))
    h = Harness(out, tiny_pair["producer"], {}, "cpu", torch.float32, droid_k=2)
    assert h.methods == ["oracle", "base", "raw", "int8", "int4", "reuse", "droidspeak", "scd"]
    assert h.diagnostics == ["scd-oracle-patch"]
    exs = tasks.generate("qa", "eval", 3, seed=0)
    variants = [(m, m, None) for m in h.methods] + [("scd@4:4", "scd", (4, 4))]
    variants += [(q, q, None) for q in ("scd:int8", "scd:int4", "reuse:int4")] + [("scd:int4@4:4", "scd:int4", (4, 4))]
    res = h.evaluate(h.consumers["self"], exs, variants, batch=3)
    for meth in ("base", "raw", "reuse", "droidspeak", "scd"):
        assert res[meth]["preds"] == res["oracle"]["preds"], meth
        assert res[meth]["kl_sum"] / res[meth]["tokens"] < 1e-5 and res[meth]["top1_sum"] == res[meth]["tokens"], meth
    for meth in ("int8", "int4"):
        assert 0 < res[meth]["kl_sum"] / res[meth]["tokens"] < 0.5, meth
    assert res["int8"]["kl_sum"] < res["int4"]["kl_sum"]
    assert res["scd@4:4"]["kl_sum"] > res["scd"]["kl_sum"]  # a lower level is a coarser code
    assert all(s is not None for s in res["scd@4:4"]["scores"])
    # quantised codes: int8 near the float codes, int4 coarser, the level still coarser; fewer bytes
    kl = {k: res[k]["kl_sum"] / res[k]["tokens"] for k in res}
    assert kl["scd"] < kl["scd:int8"] < kl["scd:int4"] < 0.5 and kl["scd:int4"] < kl["scd:int4@4:4"]
    assert kl["reuse:int4"] > kl["reuse"]
    bpt = h.bytes_per_token()
    assert bpt["scd:int4"] < bpt["scd:int8"] < bpt["scd"] and bpt["reuse:int4"] == bpt["scd:int4"]
    assert h.bytes_per_token((4, 4))["scd:int4"] < bpt["scd:int4"]
    assert bpt["raw"] == 4 * 2 * 2 * 16 * 2 and bpt["int4"] < bpt["int8"] < bpt["raw"]
    assert h.bytes_per_token((4, 4))["scd"] == bpt["scd"] // 4
    t = h.timings(h.consumers["self"], tasks.chat_prompt_ids(h.tokenizer, exs[0]), variants, repeats=1)
    assert t["prefill_s"] > 0 and set(t["rebuild_s"]) == {v[0] for v in variants} - {"base"}


@pytest.mark.heavy  # about 25 s on 2 cores: CI leaves it out (README, Tests)
@pytest.mark.slow
def test_scd_eval_quick_writes_table_sweep_drift_and_adaptive(tiny_pair, tmp_path, smollm2_path):
    import json

    import scd_eval
    from sgl_kvxfer.scd.calib.calibrate import calibrate, parse_args

    out = str(tmp_path / "art")
    calibrate(parse_args(["--producer", tiny_pair["producer"], "--consumer", f"qa={tiny_pair['a']}",
                          "--consumer", f"code={tiny_pair['b']}", "--calib", "task:qa", "task:code", "--r-k", "8",
                          "--r-v", "8", "--rank-levels", "2:2,4:4", "--r-h", "16", "--patch-budget", "1", "--pool", "2",
                          "--out", out, "--num-prefixes", "6", "--batch-size", "3", "--select-prompts", "2",
                          "--aligner-hidden", "8", "--aligner-steps", "20", "--device", "cpu", "--save-stats"]))
    path = scd_eval.main(["--artifacts", out, "--quick", "--device", "cpu", "--out-dir", str(tmp_path / "res"),
                          "--rates", "1", "100"])
    p = json.load(open(path))
    from sgl_kvxfer import tasks

    # the generation caps the scores were produced under
    assert p["max_answer_tokens"] == {t: tasks.get_task(t).max_answer_tokens for t in ("qa", "code")}
    meths = p["summary"]["methods"]
    assert {"oracle", "base", "raw", "int8", "int4", "reuse", "droidspeak", "scd", "scd@2:2", "reuse@4:4",
            "scd-oracle-patch", "scd:int4", "scd:int4@2:2", "reuse:int8@4:4"} <= set(meths)
    assert meths["scd:int4@2:2"]["bytes_per_token"] < meths["scd@2:2"]["bytes_per_token"]
    # the matched rows consider every code dtype of a family
    assert scd_eval.family("scd:int4@2:2") == "scd" and scd_eval.family("scd-oracle-patch") != "scd"
    # the diagnostic row: scored like the methods, marked, no bytes, off the front and the matched rows
    diag = meths["scd-oracle-patch"]
    assert diag["diagnostic"] and diag["bytes_per_token"] is None and 0 < diag["top1"] <= 1
    assert not any(meths[k].get("diagnostic") for k in meths if k != "scd-oracle-patch")
    assert set(p["diagnostics"]) == {"scd-oracle-patch"} and "scd-oracle-patch" not in p["summary"]["pareto_scd_reuse"]
    assert all(r.get(f, {}).get("variant") != "scd-oracle-patch" for r in p["summary"]["matched_bytes"].values()
               for f in ("scd", "reuse"))
    assert "scd-oracle-patch" in p["timings"]["qa"]["rebuild_s"]
    assert meths["scd@2:2"]["bytes_per_token"] < meths["scd@4:4"]["bytes_per_token"] < meths["scd"]["bytes_per_token"]
    # the sweep's levels are scored against the oracle too (answer tokens counted, top-1 in [0, 1])
    for c in ("qa", "code"):
        assert p["results"][c]["scd@2:2"]["answer_tokens"] == p["results"][c]["scd"]["answer_tokens"] > 0
    assert 0 < meths["scd@4:4"]["top1"] <= 1
    assert set(p["drift"]) == {"qa", "code"} and len(p["drift"]["qa"]["k_cos"]) == 4
    assert set(p["adaptive"]["rates"]) == {"1", "100"} and "ttft_vs_best_fixed" in p["adaptive"]["rates"]["1"]["adaptive"]
    assert "int4" in p["summary"]["matched_bytes"] and os.path.isfile(path[:-5] + ".png")
    # the adaptive rows recomputed from the result alone are the eval's own; with a floor, the
    # policy never sends a level below it
    again = json.load(open(scd_eval.main(["--adaptive-from", path, "--min-level", "4:4", "--rates", "1", "100",
                                          "--out-dir", str(tmp_path / "res2")])))["adaptive"]
    for rate, row in p["adaptive"]["rates"].items():
        got, want = again["rates"][rate]["adaptive"], row["adaptive"]
        assert got["level_counts"] == want["level_counts"], rate
        assert (got["score"], got["ttft_ms"]) == pytest.approx((want["score"], want["ttft_ms"])), rate
        assert set(again["rates"][rate]["adaptive_floor"]["level_counts"]) <= {"scd@4:4", "scd"}, rate
    assert again["min_level"] == "4:4"
    # the calibration measured each level's agreement: the policy with --scd-min-rank auto's floor
    # is modelled too, and never sends a level below that floor
    from sgl_kvxfer.scd.rank_policy import quality_floor

    agreement = p["manifest"]["level_agreement"]
    assert len(agreement) == 3 and p["adaptive"]["level_agreement"] == agreement
    floor = quality_floor(agreement)
    labels = ["scd@2:2", "scd@4:4", "scd"]
    assert p["adaptive"]["quality_floor"] == ["2:2", "4:4", "8:8"][floor]
    for rate, row in p["adaptive"]["rates"].items():
        assert set(row["adaptive_quality"]["level_counts"]) <= set(labels[floor:]), rate
        vs = row["adaptive_quality"]["vs_fastest_within_a_point"]
        best = max(row[lab]["score"] for lab in labels)
        assert row[vs["level"]]["score"] >= best - 0.01, rate
        assert all(row[lab]["ttft_ms"] >= row[vs["level"]]["ttft_ms"] for lab in labels
                   if row[lab]["score"] >= best - 0.01), rate
    # whatever this tiny calibration measured: with agreement only the top level keeps, the
    # modelled policy sends the top level at every rate, where the rule alone (a wire budget too
    # small for any level) sends the lowest
    src = json.load(open(path))
    src["manifest"]["level_agreement"] = [0.1, 0.5, 0.9]
    forced = tmp_path / "forced.json"
    forced.write_text(json.dumps(src))
    top_only = json.load(open(scd_eval.main(["--adaptive-from", str(forced), "--rates", "1", "100",
                                             "--wire-frac", "1e-9", "--out-dir", str(tmp_path / "res3")])))
    top_only = top_only["adaptive"]
    assert top_only["quality_floor"] == "8:8"
    for rate, row in top_only["rates"].items():
        assert row["adaptive_quality"]["level_counts"] == {"scd": 6}, rate
        assert row["adaptive"]["level_counts"] == {"scd@2:2": 6}, rate


@pytest.mark.slow
def test_oracle_patch_diagnostic_is_the_oracle_when_every_layer_is_patch(tiny_pair, tmp_path, smollm2_path):
    """scd-oracle-patch takes the Patch layers from the consumer's own prefill: with every layer a
    Patch layer it is the oracle exactly (answers, KL 0, top-1 1) while SCD itself (imperfect
    aligners) is not; with one Patch layer it keeps SCD's Reuse layers (not the oracle)."""
    from scd_harness import Harness
    from sgl_kvxfer import tasks
    from sgl_kvxfer.scd.calib.calibrate import calibrate, parse_args

    exs = tasks.generate("qa", "eval", 3, seed=0)
    res = {}
    for k in (4, 1):  # TINY has 4 layers
        out = str(tmp_path / f"art{k}")
        calibrate(parse_args(["--producer", tiny_pair["producer"], "--consumer", f"qa={tiny_pair['b']}",
                              "--calib", "task:qa", "--r-k", "8", "--r-v", "8", "--r-h", "16", "--patch-budget", str(k),
                              "--k-max", "4", "--pool", "4", "--out", out, "--num-prefixes", "6", "--batch-size", "3",
                              "--select-prompts", "2", "--aligner-hidden", "8", "--aligner-steps", "10",
                              "--device", "cpu"]))
        h = Harness(out, tiny_pair["producer"], {}, "cpu", torch.float32)
        assert len(h.m.patch_layers) == k and h.diagnostics == ["scd-oracle-patch"]
        variants = [(m, m, None) for m in ("oracle", "scd", "scd-oracle-patch")]
        res[k] = h.evaluate(h.consumers["qa"], exs, variants, batch=3)
    kl = {k: {m: r["kl_sum"] / r["tokens"] for m, r in res[k].items()} for k in res}
    full = res[4]["scd-oracle-patch"]
    assert full["preds"] == res[4]["oracle"]["preds"] and full["scores"] == res[4]["oracle"]["scores"]
    assert kl[4]["scd-oracle-patch"] < 1e-6 and full["top1_sum"] == full["tokens"]
    assert kl[4]["scd"] > 1e-3  # the aligners are not perfect: the diagnostic is not SCD itself
    assert kl[1]["scd-oracle-patch"] > 1e-3  # three Reuse layers left: not the oracle


def test_compact_averages_each_metric_over_the_items_that_have_it():
    """A consumer asked several tasks (--consumer-tasks NAME=qa+code) scores items with different
    metrics: each metric is averaged over its own items, and every item keeps its headline."""
    import scd_eval

    res = {"raw": {"scores": [{"f1": 0.5, "em": 0.0}, {"pass": 1.0, "em": 1.0}, None, {"f1": 1.0, "em": 1.0}],
                   "kl_sum": 2.0, "tokens": 4, "top1_sum": 3.0, "rebuild_s": 0.0, "prefix_tokens": 10, "preds": []}}
    row = scd_eval.compact(res)["raw"]
    assert row["metrics"] == {"f1": 0.75, "em": 2 / 3, "pass": 1.0}
    assert row["item_scores"] == [0.5, 1.0, 1.0] and row["kl"] == 0.5 and row["top1"] == 0.75
