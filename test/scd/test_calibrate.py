"""Calibration end to end on a tiny random pair (two consumers), then serving-side use of the
artifacts it wrote: pair check, encode once, decode per consumer."""
import json
import os
import random

import pytest
import torch

from sgl_kvxfer.models.loader import load_model
from sgl_kvxfer.scd import ScdArtifacts, ScdDecoder, ScdEncoder, kv_projections
from sgl_kvxfer.scd.calib.calibrate import calibrate, parse_args
from sgl_kvxfer.scd.calib.forward import LlamaRunner
from sgl_kvxfer.scd.calib.methods import producer_state, scd_cache


def synthetic_calib(tmp_path) -> list[str]:
    rng = random.Random(0)
    words = "the of and to in is was for on that with as by at from they which this be".split()
    words += [f"w{i}" for i in range(200)]
    paths = []
    for name in ("code", "prose"):
        path = tmp_path / f"{name}_calib.jsonl"
        path.write_text("".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(300))}) + "\n"
                                for _ in range(10)))
        paths.append(str(path))
    return paths


def test_calibrate_tiny_pair_end_to_end(tiny_pair, tmp_path):
    out = str(tmp_path / "art")
    cfg = parse_args(["--producer", tiny_pair["producer"], "--consumer", f"a={tiny_pair['a']}",
                      "--consumer", f"b={tiny_pair['b']}", "--calib", *synthetic_calib(tmp_path),
                      "--r-k", "8", "--r-v", "8", "--r-h", "16", "--patch-budget", "1", "--out", out,
                      "--prefix-len", "48", "--num-prefixes", "12", "--batch-size", "6", "--select-prompts", "4",
                      "--select-prefix", "16", "--select-cont", "6", "--aligner-hidden", "16",
                      "--aligner-steps", "30", "--aligner-tokens", "256", "--device", "cpu", "--save-stats"])
    report = calibrate(cfg)
    assert set(report["wall_s"]) >= {"load", "collect_kv", "fit_reuse", "select", "collect_h", "fit_patch", "total"}
    assert len(report["patch_layers"]) == 1 and report["selection"]["k"] == 1
    assert len(report["selection"]["restore_one"]) == 4 and len(report["droidspeak_restore_one"]) == 4
    assert report["tokens"]["fit_prefixes"] == 12
    for f in ("manifest.json", "producer.safetensors", "consumer_a.safetensors", "consumer_b.safetensors",
              "calibration.json", "reuse_stats.safetensors"):
        assert os.path.isfile(os.path.join(out, f)), f
    # level agreement, measured after the save and written into the manifest
    la = report["level_agreement"]
    assert la["levels"] == [[8, 8]] and len(la["agreement"]) == 1 and 0 <= la["agreement"][0] <= 1
    assert la["tokens"] > 0 and set(la["per_consumer"]) == {"a", "b"}
    assert ScdArtifacts.load(out).manifest.level_agreement == tuple(la["agreement"])
    # The fits are real: the reuse error grows with depth as the perturbation compounds, and is < 1.
    errs = report["reuse_fit_rel_err"]["b"]["k_rel_err"]
    assert 0 < errs[0] < errs[-1] < 1
    # Serving-side use: both consumers decode the same codes; patch layer regenerated with own weights.
    art = ScdArtifacts.load(out)
    assert art.check_pair(tiny_pair["producer"], tiny_pair["b"]) == "b"
    m = art.manifest
    assert m.patch_layers == tuple(report["patch_layers"]) and len(m.reuse_layers) == 3
    prod, _ = load_model(tiny_pair["producer"], "auto", torch.float32, "cpu", 0)
    ids = torch.arange(500, 520)[None]
    pos = torch.arange(20)[None]
    valid = torch.ones_like(ids, dtype=torch.bool)
    state = producer_state(LlamaRunner(prod), ids, pos, valid, h_layers=m.patch_layers)
    enc = ScdEncoder(art)
    for name in ("a", "b"):
        cons, _ = load_model(tiny_pair[name], "auto", torch.float32, "cpu", 0)
        oracle, _ = LlamaRunner(cons).prefill_cache(ids, pos, valid)
        rebuilt = scd_cache(state, enc, ScdDecoder(art, name), kv_projections(cons), torch.float32)
        for layer in range(m.num_layers):
            rel = (rebuilt.k[layer] - oracle.k[layer]).norm() / oracle.k[layer].norm()
            raw = (state.cache.k[layer] - oracle.k[layer]).norm() / oracle.k[layer].norm()
            assert rel < 1.0 and rebuilt.k[layer].shape == oracle.k[layer].shape, (name, layer, rel, raw)


def _tiny_args(tiny_pair, tmp_path, out, *extra) -> list[str]:
    return ["--producer", tiny_pair["producer"], "--consumer", f"a={tiny_pair['a']}",
            "--consumer", f"b={tiny_pair['b']}", "--calib", *synthetic_calib(tmp_path),
            "--r-k", "8", "--r-v", "8", "--r-h", "16", "--out", out,
            "--prefix-len", "48", "--num-prefixes", "12", "--batch-size", "6", "--select-prompts", "4",
            "--select-prefix", "16", "--select-cont", "6", "--aligner-hidden", "16",
            "--aligner-steps", "30", "--aligner-tokens", "256", "--device", "cpu", *extra]


def test_patch_layers_share_the_time_budget(monkeypatch):
    """--time-budget-s: each Patch layer's turn is its share of what is left before the deadline
    less the save reserve, capped by --aligner-time-s; a share under MIN_LAYER_S goes to fewer
    layers, and with no time left the layer is dropped; bad budgets are refused."""
    import pytest

    from sgl_kvxfer.scd.calib import budget as B

    t = [1000.0]
    monkeypatch.setattr(B, "clock", lambda: t[0])
    monkeypatch.setattr(B, "process_age_s", lambda: 0.0)
    assert B.Budget(0.0).layer_share(5) == 0.0  # no deadline, no cap: no limit
    assert B.Budget(0.0, cap_s=4.0).layer_share(5) == 4.0
    b = B.Budget(B.SAVE_RESERVE_S + 60)
    assert b.layer_share(6) == pytest.approx(10.0)
    assert B.Budget(B.SAVE_RESERVE_S + 60, cap_s=4.0).layer_share(6) == 4.0
    t[0] += 57.5  # 2.5 s left: two layers of 1.25 s, not six of 0.42 s
    assert b.layer_share(6) == pytest.approx(1.25)
    t[0] += 2.0
    assert b.layer_share(3) is None  # under MIN_LAYER_S left: drop
    # from the command line the deadline counts from the process's start, not from the Budget's
    monkeypatch.setattr(B, "process_age_s", lambda: 30.0)
    assert B.Budget(B.SAVE_RESERVE_S + 60, started=B.process_start()).left() == pytest.approx(30.0)
    assert B.Budget(B.SAVE_RESERVE_S + 60).left() == pytest.approx(60.0)
    for bad in ("nan", "-1", "inf"):
        with pytest.raises(ValueError):
            parse_args(["--consumer", "a=x", "--time-budget-s", bad])


def test_process_age_is_this_process():
    import time

    from sgl_kvxfer.scd.calib.budget import process_age_s

    age = process_age_s()
    assert age > 0.1  # the interpreter started and imported torch before this test ran
    time.sleep(0.3)
    assert abs(process_age_s() - age - 0.3) < 0.1  # /proc's ticks are 10 ms


def test_a_budget_too_small_for_every_aligner_still_writes_the_artifacts(tiny_pair, tmp_path, monkeypatch):
    """A budget that leaves one aligner turn of three: the first layer in greedy order trains, the
    other two are dropped (they stay Reuse, calibration.json says why, a warning says so), and the
    artifact set is complete and loads. A fake clock that only the aligners move makes it exact."""
    import pytest

    from sgl_kvxfer.scd.calib import budget as B
    from sgl_kvxfer.scd.calib import stages

    t = [0.0]
    monkeypatch.setattr(B, "clock", lambda: t[0])
    real, turns = stages.train_aligners, []

    def timed(*a, time_budget_s=0.0, **kw):  # each aligner uses its whole turn of the fake clock
        turns.append(time_budget_s)
        t[0] += time_budget_s
        return real(*a, time_budget_s=time_budget_s, **kw)

    monkeypatch.setattr(stages, "train_aligners", timed)
    out = str(tmp_path / "art")
    # 1.5 s after the save reserve: one turn of at least MIN_LAYER_S, not three
    cfg = parse_args(_tiny_args(tiny_pair, tmp_path, out, "--patch-budget", "3",
                                "--time-budget-s", str(B.SAVE_RESERVE_S + 1.5)))
    with pytest.warns(RuntimeWarning, match="dropped"):
        report = calibrate(cfg)
    greedy = [g["layer"] for g in report["selection"]["greedy"]]
    assert len(report["selection"]["layers"]) == 3
    assert turns == [pytest.approx(1.5)]
    assert report["patch_layers"] == greedy[:1]
    assert report["patch_dropped"] == {str(layer): "time" for layer in greedy[1:]}
    assert set(report["aligners"]["a"]) == {str(greedy[0])}
    art = ScdArtifacts.load(out)
    assert art.manifest.patch_layers == tuple(greedy[:1]) and len(art.manifest.reuse_layers) == 3
    assert art.check_pair(tiny_pair["producer"], tiny_pair["a"]) == "a"
    with open(os.path.join(out, "calibration.json")) as f:
        assert json.load(f)["patch_dropped"] == report["patch_dropped"]
    # no time for any aligner: every selected layer stays Reuse, the set still loads
    cfg = parse_args(_tiny_args(tiny_pair, tmp_path, out, "--patch-budget", "2",
                                "--time-budget-s", str(B.SAVE_RESERVE_S / 2)))
    turns.clear()
    with pytest.warns(RuntimeWarning, match="dropped"):
        report = calibrate(cfg)
    assert turns == [] and report["patch_layers"] == [] and len(report["patch_dropped"]) == 2
    assert "fit_patch" not in report["wall_s"]
    art = ScdArtifacts.load(out)
    assert art.manifest.patch_layers == () and len(art.manifest.reuse_layers) == 4


def test_sigint_while_aligners_train_saves_the_trained_layers(tiny_pair, tmp_path, monkeypatch):
    """A SIGINT (timeout -s INT around the run) during the second aligner turn: the first layer
    keeps its aligner, the interrupted one and the rest are dropped, the artifacts are written."""
    import pytest

    from sgl_kvxfer.scd.calib import stages

    real, calls = stages.train_aligners, []

    def interrupted(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(stages, "train_aligners", interrupted)
    out = str(tmp_path / "art")
    with pytest.warns(RuntimeWarning, match="interrupted"):
        report = calibrate(parse_args(_tiny_args(tiny_pair, tmp_path, out, "--patch-budget", "3")))
    greedy = [g["layer"] for g in report["selection"]["greedy"]]
    assert report["patch_layers"] == greedy[:1]
    assert report["patch_dropped"] == {str(layer): "interrupted" for layer in greedy[1:]}
    assert ScdArtifacts.load(out).manifest.patch_layers == tuple(greedy[:1])


def test_joint_aligners_and_int4_codes(tiny_pair, tmp_path):
    """--aligner-joint trains every Patch layer's aligners in one pass; --code-dtype int4 puts the
    codes on the int4 wire grid (the aligners train on the codes as received), the manifest says
    so and its bytes per token count the integers and the per-token scales."""
    from sgl_kvxfer.mem_cache.scd_quant import field_bytes

    out = str(tmp_path / "art")
    report = calibrate(parse_args(_tiny_args(tiny_pair, tmp_path, out, "--patch-budget", "2", "--aligner-joint",
                                             "--code-dtype", "int4", "--code-scale", "unit", "--aligner-h-weight", "0.1",
                                             "--aligner-batch", "64")))
    assert len(report["patch_layers"]) == 2 and not report["patch_dropped"]
    for name in ("a", "b"):
        assert set(report["aligners"][name]) == {str(x) for x in report["patch_layers"]}
        assert all(r["joint"] and r["val_loss_best"] <= r["val_loss_linear"] for r in report["aligners"][name].values())
    m = ScdArtifacts.load(out).manifest
    assert m.dtype == "int4" and m.wire_bits == 4
    assert m.code_scale == "unit"
    h = m.num_kv_heads
    assert m.bytes_per_token == 2 * (field_bytes(h * 8, 4) + field_bytes(h * 8, 4)) + 2 * field_bytes(16, 4)
    import pytest

    for bad in (["--code-dtype", "int3"], ["--aligner-batch", "0"], ["--aligner-aux", "0", "--aligner-h-weight", "0"],
                ["--aligner-h-weight", "nan"], ["--code-scale", "whiten"]):
        with pytest.raises(ValueError):
            parse_args(["--consumer", "a=x", *bad])


def test_level_agreement_per_nested_level(tiny_pair, tmp_path):
    """With nested levels the calibration measures each level's agreement with the consumers' own
    prefill on the held-out selection items; the manifest carries the consumer mean per level, and
    `--scd-min-rank auto` on a producer floors at the lowest level within a point of the top."""
    from sgl_kvxfer.scd.rank_policy import LevelChooser, quality_floor

    out = str(tmp_path / "art")
    report = calibrate(parse_args(_tiny_args(tiny_pair, tmp_path, out, "--patch-budget", "1",
                                             "--rank-levels", "1:1,4:4")))
    la = report["level_agreement"]
    assert la["levels"] == [[1, 1], [4, 4], [8, 8]]
    for i, lv in enumerate(la["levels"]):
        per = [la["per_consumer"][n]["{}:{}".format(*lv)]["agreement"] for n in ("a", "b")]
        assert la["agreement"][i] == pytest.approx(sum(per) / 2, abs=1e-6)
    # rank 1 of 8 loses agreement the top level keeps (log-probs of random text say nothing here);
    # a whole item agrees less often than its tokens do
    assert la["token_agreement"][0] < la["token_agreement"][-1] and len(la["logprob"]) == 3
    assert la["agreement"][0] <= la["agreement"][-1]
    assert all(a <= t for a, t in zip(la["agreement"], la["token_agreement"]))
    assert la["items"] == 4
    m = ScdArtifacts.load(out).manifest
    assert m.level_agreement == tuple(la["agreement"])
    chooser = LevelChooser(m.levels, [m.bytes_per_token_at(lv) for lv in m.levels], "auto", 0.25, "auto",
                           m.level_agreement)
    assert chooser.floor == quality_floor(m.level_agreement) >= 1
