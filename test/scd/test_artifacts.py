"""SCD manifest: validation, JSON round trip, and the pair check (a mismatched pair is an error)."""
import dataclasses
import json
import os

import pytest

from sgl_kvxfer.models.arch_config import ModelArchConfig
from sgl_kvxfer.scd import ScdArtifacts, ScdPairError, identify, make_random_artifacts

from scd_tiny import tiny_state, write_model


def _bound(tiny_pair, tmp_path):
    arch = ModelArchConfig.from_dir(tiny_pair["producer"])
    art = make_random_artifacts(arch, ["a"], r_k=4, r_v=4, r_h=8, patch_layers=[1], seed=0)
    m = dataclasses.replace(art.manifest, producer=identify(tiny_pair["producer"], name="producer"),
                            consumers=(identify(tiny_pair["a"], name="a"),))
    art = ScdArtifacts(m, art.tensors)
    art.save(str(tmp_path))
    return ScdArtifacts.load(str(tmp_path))


def test_check_pair_accepts_the_calibrated_pair(tiny_pair, tmp_path):
    art = _bound(tiny_pair, tmp_path)
    assert art.check_pair(tiny_pair["producer"], tiny_pair["a"]) == "a"
    assert art.check_pair(consumer=(tiny_pair["a"], None)) == "a"
    # a config alone checks the architecture only
    assert art.check_pair(consumer=ModelArchConfig.from_dir(tiny_pair["b"])) == "a"
    with open(os.path.join(str(tmp_path), "manifest.json")) as f:
        d = json.load(f)
    assert d["consumers"][0]["name"] == "a" and d["patch_layers"] == [1] and d["bytes_per_token"] > 0


def test_check_pair_rejects_other_weights_and_architectures(tiny_pair, tmp_path):
    art = _bound(tiny_pair, tmp_path)
    with pytest.raises(ScdPairError, match="consumer: its weights differ"):
        art.check_pair(consumer=tiny_pair["b"])
    with pytest.raises(ScdPairError, match="producer: its weights differ"):
        art.check_pair(producer=tiny_pair["a"])
    wide = dict(tiny_pair["cfg"], intermediate_size=96)
    other = write_model(tmp_path / "wide", wide, tiny_state(wide, 0))
    with pytest.raises(ScdPairError, match=r"architecture \(config hash\)"):
        art.check_pair(consumer=other)


def test_manifest_validation(tiny_pair):
    arch = ModelArchConfig.from_dir(tiny_pair["producer"])
    m = make_random_artifacts(arch, 2, r_k=4, r_v=4, r_h=8, patch_layers=[0], seed=0).manifest
    assert m.consumer_names == ("c0", "c1")
    with pytest.raises(ValueError, match="partition"):
        dataclasses.replace(m, patch_layers=(0, 1))
    with pytest.raises(ValueError, match="r_k, r_v"):
        dataclasses.replace(m, r_k=arch.head_dim + 1)
    with pytest.raises(ValueError, match="unique"):
        dataclasses.replace(m, consumers=m.consumers[:1] * 2)
    assert [e[:2] for e in m.code_layout()[:3]] == [(0, "h"), (1, "k"), (1, "v")]


def test_level_agreement_is_one_share_per_level_and_optional(tiny_pair, tmp_path):
    from sgl_kvxfer.scd.artifacts import ScdManifest

    arch = ModelArchConfig.from_dir(tiny_pair["producer"])
    art = make_random_artifacts(arch, 1, r_k=4, r_v=4, r_h=8, patch_layers=[0], seed=0, rank_levels=[(2, 2)])
    m = art.manifest
    assert m.level_agreement == () and len(m.levels) == 2
    for bad in ((0.5,), (0.5, 0.6, 0.7), (0.5, 1.5), (-0.1, 0.5)):
        with pytest.raises(ValueError, match="level_agreement"):
            dataclasses.replace(m, level_agreement=bad)
    art.manifest = dataclasses.replace(m, level_agreement=(0.25, 0.75))
    art.save(str(tmp_path))
    assert ScdArtifacts.load(str(tmp_path)).manifest.level_agreement == (0.25, 0.75)
    # a manifest written without the field (older artifacts) still loads, without it
    d = m.to_dict()
    del d["level_agreement"]
    assert ScdManifest.from_dict(d).level_agreement == ()
    # save_manifest rewrites the manifest alone
    art.manifest = dataclasses.replace(m, level_agreement=(0.5, 0.5))
    art.save_manifest(str(tmp_path))
    assert ScdArtifacts.load(str(tmp_path)).manifest.level_agreement == (0.5, 0.5)
    assert not os.path.exists(os.path.join(str(tmp_path), "manifest.json.tmp"))


def test_runtime_imports_no_offline_tooling():
    """The serving runtime (server, scheduler, disagg, the SCD codec) never imports calibration,
    the task suite or training code."""
    import subprocess
    import sys

    code = ("import sys; import sgl_kvxfer.launch_server, sgl_kvxfer.disagg.scd_prefill, sgl_kvxfer.disagg.scd_decode, "
            "sgl_kvxfer.scheduler.scheduler, sgl_kvxfer.scd; "
            "bad = [m for m in sys.modules if m.startswith(('sgl_kvxfer.scd.calib', 'sgl_kvxfer.tasks'))]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
