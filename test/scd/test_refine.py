"""refine: a later process resumes a calibration's aligners on the same held-out split and
rewrites only the aligner tensors."""
import json
import os

import pytest
import torch

from sgl_kvxfer.scd import ScdArtifacts
from sgl_kvxfer.scd.calib.calibrate import calibrate, parse_args
from sgl_kvxfer.scd.calib.refine import REFINE_LR_FRACTION, refine
from test_calibrate import _tiny_args


@pytest.mark.parametrize("joint", [True, False])
def test_refine_resumes_each_aligner_where_calibration_left_it(tiny_pair, tmp_path, joint):
    out = str(tmp_path / "art")
    extra = ["--patch-budget", "2", "--aligner-batch", "64"] + (["--aligner-joint"] if joint else [])
    report = calibrate(parse_args(_tiny_args(tiny_pair, tmp_path, out, *extra)))
    before = ScdArtifacts.load(out)
    argv = ["--artifacts", out, "--time-budget-s", "120", "--device", "cpu"]  # as main() passes them
    record = refine(out, time_budget_s=120.0, device="cpu", argv=argv)
    after = ScdArtifacts.load(out)
    # the same split, codes and parameters: each aligner resumes at the held-out loss it was saved at
    for name in ("a", "b"):
        for layer in map(str, report["patch_layers"]):
            saved = report["aligners"][name][layer]["val_loss_best"]
            rep = record["aligners"][name][layer]
            assert rep["val_loss_linear"] == pytest.approx(saved, rel=1e-3, abs=1e-6), (name, layer)
            assert rep["val_loss_best"] <= rep["val_loss_linear"]
            assert rep["steps_run"] > 0
    # only aligner tensors may change (on this tiny bed none beats its saved held-out loss, so
    # each keeps its parameters: test_aligner's resume test shows the descent continuing)
    assert set(after.tensors) == set(before.tensors)
    for k, t in before.tensors.items():
        if "/a_" not in k:
            assert torch.equal(after.tensors[k], t), k
    assert after.manifest.to_dict() == before.manifest.to_dict()
    # the level agreement is measured again with the refined (here unchanged) aligners
    assert before.manifest.level_agreement and record["level_agreement"]["agreement"] == list(
        after.manifest.level_agreement)
    cal = json.load(open(os.path.join(out, "calibration.json")))
    assert len(cal["refinements"]) == 1 and cal["refinements"][0]["wall_s"]["total"] > 0
    assert cal["refinements"][0]["command"] == "python -m sgl_kvxfer.scd.calib.refine " + " ".join(argv)
    # by default the restart peaks near where the calibration's annealing ended, not at its peak
    assert cal["refinements"][0]["lr"] == pytest.approx(cal["config"]["aligner_lr"] * REFINE_LR_FRACTION)
    assert all(r["refined"] == 1 for per in cal["aligners"].values() for r in per.values())
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".refine.")]


def test_refine_into_another_dir_keeps_the_source(tiny_pair, tmp_path):
    src, dst = str(tmp_path / "art"), str(tmp_path / "refined")
    calibrate(parse_args(_tiny_args(tiny_pair, tmp_path, src, "--patch-budget", "1", "--save-stats")))
    source_files = {f: open(os.path.join(src, f), "rb").read() for f in os.listdir(src)}
    refine(src, time_budget_s=120.0, out=dst, device="cpu")
    assert {f: open(os.path.join(src, f), "rb").read() for f in os.listdir(src)} == source_files
    assert set(os.listdir(dst)) == set(source_files)
    assert ScdArtifacts.load(dst).check_pair(tiny_pair["producer"], tiny_pair["a"]) == "a"


def test_refine_refuses_what_it_cannot_continue(tmp_path):
    with pytest.raises(FileNotFoundError, match="calibration.json"):
        refine(str(tmp_path), time_budget_s=10.0)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="time-budget"):
            refine(str(tmp_path), time_budget_s=bad)
    with pytest.raises(ValueError, match="aligner-lr"):
        refine(str(tmp_path), time_budget_s=10.0, lr=float("nan"))
