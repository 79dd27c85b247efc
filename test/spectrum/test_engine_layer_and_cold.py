"""Per-layer budgets, KIVI and the cold tier through the engine, on a tiny dummy-weights model (CPU)."""
import argparse
import random

import pytest

from sgl_kvxfer.spectrum.layer_budget import LayerProfile

KW = dict(load_format="dummy", dtype="bfloat16", device="cpu", attention_backend="torch", max_total_tokens=6000,
          kv_tier_budget=0.3, kv_int4="on", kv_decode_recent=8)
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engines(tiny_preset_dir):
    from sgl_kvxfer import Engine

    with Engine(tiny_preset_dir, **KW) as plain, Engine(tiny_preset_dir, kv_cold_tier=True,
                                                         kv_promote_threshold=0.05, kv_promote_interval=2,
                                                         kv_promote_radius=2, **KW) as cold:
        yield plain, cold


def prompts(n=3, length=300, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(length)] for _ in range(n)]


def extra(engine):
    return engine.get_server_info()["extra"]


def test_cold_tier_that_never_fires_changes_nothing(engines):
    plain, cold = engines
    ids = prompts()
    cold.scheduler.tiering.cold.threshold = 1.0 + 1e-6  # no probability reaches it
    try:
        ref = [o["output_ids"] for o in plain.generate(input_ids=ids, sampling_params=GREEDY)]
        assert [o["output_ids"] for o in cold.generate(input_ids=ids, sampling_params=GREEDY)] == ref
    finally:
        cold.scheduler.tiering.cold.threshold = 0.05
    info = extra(cold)["kv_cold_tier"]
    assert info["host_copies"] > 0 and info["scoring_passes"] > 0 and info["promoted_tokens"] == 0


def test_cold_tier_promotes_and_gives_every_slot_back(engines):
    _, cold = engines
    cold.flush_cache()
    before = extra(cold)["kv_cold_tier"]
    manager = cold.scheduler.tiering.cold
    manager.threshold = 1e-3  # dummy weights attend almost uniformly: a low bar makes it fire
    try:
        outs = cold.generate(input_ids=prompts(seed=1), sampling_params=GREEDY)
    finally:
        manager.threshold = 0.05
    assert all(len(o["output_ids"]) == GREEDY["max_new_tokens"] for o in outs)
    info = extra(cold)["kv_cold_tier"]
    assert info["promoted_tokens"] > before["promoted_tokens"] and info["landed"] > before["landed"]
    assert info["promoted_bytes_h2d"] > before["promoted_bytes_h2d"] and info["pending"] == 0
    # the policy drops tokens at this budget: they keep host copies, some come back next to hits
    assert info["dropped_copies"] > before["dropped_copies"]
    assert info["restored_dropped"] > before["restored_dropped"]
    alloc = cold.runner.allocator
    alloc.debug_check()
    assert cold.flush_cache()
    assert sum(alloc.used_counts().values()) == 0  # promoted copies freed, originals cached then flushed
    assert cold.scheduler.tiering.cold.store.rows_in_use == 0


def test_kivi_and_layer_profile_run_through_the_engine(tiny_preset_dir, tmp_path):
    """The formats come from the flags, before the pool is built; the pool never changes them."""
    from sgl_kvxfer import Engine

    ids = prompts(2, 400, seed=2)
    with Engine(tiny_preset_dir, **{**KW, "kv_tier_budget": 0.2, "kv_tier_policy": "kivi"}) as kivi:
        info = extra(kivi)
        assert set(info["kv_int_formats"]["int4"]) == {"int2c"}
        kivi.generate(input_ids=ids, sampling_params={"max_new_tokens": 0})
        assert kivi.get_server_info()["kv_bytes_per_token"] <= 0.2 * info["kv_full_bytes_per_token"] * 1.02
        assert len(kivi.generate(input_ids=ids, sampling_params=GREEDY)[0]["output_ids"]) == 12
        tiering = kivi.scheduler.tiering
        with pytest.raises(ValueError, match="fixed at start-up"):  # other formats: another engine
            tiering.configure(policy="greedy")
        assert tiering.settings.policy == "kivi"
    path = str(tmp_path / "profile.json")
    LayerProfile(2, (0.5, 0.0), (0.3, 0.001), 0.1).save(path)
    # at b = 0.4 the uniform plan's int8 share pays part of layer 0's upgrade, lowering layer 1 the rest
    with Engine(tiny_preset_dir, **{**KW, "kv_tier_budget": 0.4, "kv_layer_budget": "profile",
                             "kv_layer_profile": path}) as layered:
        info = extra(layered)
        assert info["kv_int_formats"]["int4"] == ["int8", "int2c"]
        assert info["kv_layer_allocation"]["upgraded"] == [0]
        pool = layered.runner.kv_pool
        assert pool.stores[2][0].tier == 1 and type(pool.stores[2][1]).__name__ == "ChannelKeyIntPages"
        layered.generate(input_ids=ids, sampling_params={"max_new_tokens": 0})
        assert layered.get_server_info()["kv_bytes_per_token"] <= 0.4 * info["kv_full_bytes_per_token"] * 1.001
        assert len(layered.generate(input_ids=ids, sampling_params=GREEDY)[0]["output_ids"]) == 12
        layered.scheduler.tiering.configure(recency_lambda=1e-3)  # same formats: allowed


def test_cli_flags_parse():
    from sgl_kvxfer.config import ServerArgs

    ap = argparse.ArgumentParser()
    ServerArgs.add_cli_args(ap)
    ns = ap.parse_args(["--kv-layer-budget", "profile", "--kv-layer-profile", "p.json", "--kv-cold-tier",
                        "--kv-promote-threshold", "0.1", "--kv-promote-interval", "8", "--kv-promote-layers", "3",
                        "--kv-promote-radius", "6", "--kv-cold-tier-tokens", "1000", "--kv-promote-drop-run", "8",
                        "--kv-promote-max-tokens", "64"])
    assert (ns.kv_layer_budget, ns.kv_cold_tier, ns.kv_promote_threshold, ns.kv_promote_layers,
            ns.kv_promote_drop_run, ns.kv_promote_max_tokens) == ("profile", True, 0.1, 3, 8, 64)
    with pytest.raises(SystemExit):
        ap.parse_args(["--kv-layer-budget", "layerwise"])
    from sgl_kvxfer.server.flags import parse_server_args

    for bad in (["--kv-promote-threshold", "nan"], ["--kv-promote-threshold", "inf"], ["--kv-promote-interval", "0"],
                ["--kv-layer-budget", "profile"], ["--kv-cold-tier"], ["--kv-cold-tier-tokens", "-5"],
                ["--kv-promote-radius", "1e9"], ["--kv-cold-tier", "--kv-layer-profile", "/no/such/profile.json"],
                ["--kv-layer-profile", __file__], ["--kv-promote-drop-run", "-1"],
                ["--kv-promote-drop-run", "1e9"], ["--kv-promote-drop-run", "nan"],
                ["--kv-promote-max-tokens", "-1"], ["--kv-promote-max-tokens", "nan"],
                ["--kv-promote-max-tokens", "1e12"]):
        with pytest.raises(SystemExit) as exc:
            parse_server_args(["--kv-tier-budget", "0.3", *bad] if bad != ["--kv-cold-tier"] else bad)
        assert exc.value.code == 2, bad


def test_cold_tier_probes_the_profiles_most_sensitive_layers(tiny_preset_dir, tmp_path):
    """The taps are installed by the runner, from the flags, before any graph is captured."""
    from sgl_kvxfer import Engine

    path = str(tmp_path / "profile.json")
    LayerProfile(2, (0.1, 0.7), (0.3, 0.001), 0.1).save(path)
    with Engine(tiny_preset_dir, kv_cold_tier=True, kv_promote_layers=1, kv_layer_profile=path, **KW) as cold:
        manager = cold.scheduler.tiering.cold
        assert manager.layers == [1] and sorted(cold.runner.attn_backend.query_taps) == [1]
        assert len(cold.generate(input_ids=prompts(1, 200), sampling_params=GREEDY)[0]["output_ids"]) == 12
