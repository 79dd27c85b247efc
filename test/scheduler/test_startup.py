"""Start-up order (scheduler/startup.py): the int4 decision comes before the KV pool, so the
serving pool is built once, at its final split, and never re-divided. A tiny random model on CPU
(dummy weights, word-level tokenizer); the probe, when it runs, really runs on its own engine."""
import gc
import weakref

import pytest

from sgl_kvxfer.engine import model_runner
from sgl_kvxfer.models.presets import PRESETS, write_dummy_tokenizer, write_preset_config
from sgl_kvxfer.spectrum.probe import PROBE_BUDGET, PROBE_POLICY

KW = dict(load_format="dummy", device="cpu", max_total_tokens=4096, kv_tier_budget=0.5, kv_int4_probe_tokens=128)


@pytest.fixture
def tiny_dir(tmp_path):
    path = str(tmp_path / "tiny")
    write_preset_config("tiny", path)
    return write_dummy_tokenizer(path, PRESETS["tiny"]["vocab_size"])


@pytest.fixture
def pool_builds(monkeypatch, tmp_path):
    """Every KV pool a ModelRunner builds: (policy, budget, int4_allowed, weakref to the pool),
    and whether every earlier pool was already freed when it was built."""
    monkeypatch.setenv("SGL_KVXFER_PROBE_CACHE", str(tmp_path / "probe_cache"))
    builds, real = [], model_runner.create_kv_pool

    def spy(config, arch, size, dtype, device, int4_allowed=None, stored_layers=None):
        gc.collect()
        earlier_freed = all(b["pool"]() is None for b in builds)
        pool = real(config, arch, size, dtype, device, int4_allowed=int4_allowed, stored_layers=stored_layers)
        builds.append({"policy": config.kv_tier_policy, "budget": config.kv_tier_budget, "int4": int4_allowed,
                       "pool": weakref.ref(pool), "earlier_freed": earlier_freed, "plan": pool.plan})
        return pool

    monkeypatch.setattr(model_runner, "create_kv_pool", spy)
    return builds


def _serving_pool_matches(engine, build):
    tiering = engine.scheduler.tiering
    pool = engine.runner.kv_pool
    assert build["pool"]() is pool and pool.plan == build["plan"]  # the pool built is the one serving
    assert build["int4"] is tiering.int4.enabled is tiering.settings.int4_allowed
    assert (pool.plan.n4 > 0) is tiering.int4.enabled  # int4 off: no int4 store at all


@pytest.mark.parametrize("mode", ["on", "off"])
def test_forced_int4_builds_one_pool(tiny_dir, pool_builds, mode):
    from sgl_kvxfer import Engine

    with Engine(tiny_dir, kv_int4=mode, **KW) as eng:
        assert len(pool_builds) == 1 and eng.scheduler.tiering.int4.source == mode
        _serving_pool_matches(eng, pool_builds[0])
        eng.generate(input_ids=list(range(3, 200)), sampling_params={"max_new_tokens": 4})
        assert eng.runner.kv_pool.plan == pool_builds[0]["plan"]


def test_auto_probes_on_its_own_pool_then_builds_the_serving_pool_once(tiny_dir, pool_builds):
    from sgl_kvxfer import Engine

    with Engine(tiny_dir, kv_int4="auto", **KW) as eng:
        assert eng.scheduler.tiering.int4.source == "probe"
        probe, serving = pool_builds  # the probe's pool, then the serving pool: two builds, no re-division
        assert (probe["policy"], probe["budget"], probe["int4"]) == (PROBE_POLICY, PROBE_BUDGET, True)
        assert probe["plan"].total < serving["plan"].total
        assert serving["earlier_freed"]  # the probe's pool was freed before the serving one was allocated
        _serving_pool_matches(eng, serving)
    del pool_builds[:]
    with Engine(tiny_dir, kv_int4="auto", **KW) as eng:  # the cached answer: no probe, one pool
        assert eng.scheduler.tiering.int4.source == "cache" and len(pool_builds) == 1
        _serving_pool_matches(eng, pool_builds[0])


def test_policy_without_int4_builds_one_pool(tiny_dir, pool_builds):
    from sgl_kvxfer import Engine

    with Engine(tiny_dir, kv_int4="auto", kv_tier_policy="adaptive-2tier", **KW) as eng:
        assert eng.scheduler.tiering.int4.source == "unused" and len(pool_builds) == 1
        _serving_pool_matches(eng, pool_builds[0])


def test_a_tiered_runner_needs_the_decision(tiny_dir):
    from sgl_kvxfer.config import EngineConfig

    with pytest.raises(ValueError, match="int4 decision"):
        model_runner.ModelRunner(EngineConfig(model_path=tiny_dir, load_format="dummy", device="cpu",
                                              kv_tier_budget=0.5))


def test_a_pd_server_probes_on_a_plain_engine(tiny_dir, pool_builds):
    """The server process's path (create_runner) for a PD decode role: the probe's engine is a
    plain scheduler (no role is attached to it); the serving pool is still built once after it."""
    from sgl_kvxfer.config import ServerArgs
    from sgl_kvxfer.scheduler.startup import create_runner

    cfg = ServerArgs.from_flat(model_path=tiny_dir, disaggregation_mode="decode", kv_int4="auto", **KW).scheduler
    runner, _, _ = create_runner(cfg)
    assert runner.int4.source == "probe" and len(pool_builds) == 2 and pool_builds[1]["earlier_freed"]
    assert pool_builds[1]["pool"]() is runner.kv_pool and pool_builds[1]["int4"] is runner.int4.enabled
