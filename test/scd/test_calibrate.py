"""Calibration end to end on a tiny random pair (two consumers), then serving-side use of the
artifacts it wrote: pair check, encode once, decode per consumer."""
import json
import os
import random

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


def test_aligners_share_the_time_budget(monkeypatch):
    """--time-budget-s: each aligner gets its share of what is left before the deadline (less the
    save margin), capped by --aligner-time-s, never less than 1 s; bad budgets are refused."""
    import time

    import pytest

    from sgl_kvxfer.scd.calib import stages
    from sgl_kvxfer.scd.calib.calibrate import CalibConfig

    now = 1000.0
    monkeypatch.setattr(time, "perf_counter", lambda: now)
    cfg = CalibConfig(consumers=("a=x",), aligner_time_s=0.0)
    assert stages.aligner_time(cfg, None, 5) == 0.0  # no deadline, no cap: no limit
    deadline = now + stages.SAVE_MARGIN_S + 60
    assert stages.aligner_time(cfg, deadline, 6) == pytest.approx(10.0)
    assert stages.aligner_time(CalibConfig(consumers=("a=x",), aligner_time_s=4.0), deadline, 6) == 4.0
    assert stages.aligner_time(cfg, now, 3) == 1.0  # past the deadline: one held-out check's worth
    for bad in ("nan", "-1", "inf"):
        with pytest.raises(ValueError):
            parse_args(["--consumer", "a=x", "--time-budget-s", bad])
