"""int4 probe wiring at engine start: --kv-int4 semantics, the probe's own settings, the
fingerprint cache, and the serving pool sized for the answer (int4 off: no int4 store)."""
import re
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from sgl_kvxfer.config import EngineConfig
from sgl_kvxfer.scheduler import int4_probe
from sgl_kvxfer.spectrum.policies import create_tier_policy


class FakeTokenizer:
    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return text.split()


class FakeTiering:
    def __init__(self, mode, policy="greedy"):
        self.config = EngineConfig(kv_tier_budget=0.5, kv_int4=mode, kv_tier_policy=policy)
        self.policy = create_tier_policy(policy)
        self.settings = {"policy": policy, "budget": 0.5, "unit": "bytes", "int4_allowed": mode != "off"}

    @contextmanager
    def using(self, **changes):
        old = dict(self.settings)
        self.settings.update(changes)
        yield self
        self.settings = old


class FakeScheduler:
    def __init__(self):
        self.runner = SimpleNamespace(hf_config={"model_type": "fake"}, model=torch.nn.Linear(4, 4),
                                      model_dir="/nonexistent")
        self.flushes = 0

    def flush_cache(self):
        self.flushes += 1


@pytest.fixture
def trial_log(monkeypatch):
    """Fake trial runner: answers the passcode for the trials whose index is in `correct`."""
    log = SimpleNamespace(calls=[], correct={0, 1, 2})

    def run(scheduler, tokenizer, prompt, max_new_tokens=32):
        log.calls.append(dict(log.tiering.settings))
        code = re.search(r"passcode is (\d{7})", prompt).group(1)
        return code if len(log.calls) - 1 in log.correct else "I do not know."

    monkeypatch.setattr(int4_probe, "run_engine_trial", run)
    monkeypatch.setattr(int4_probe, "load_filler_texts", lambda: ["alpha beta gamma delta\n" * 400] * 3)
    return log


@pytest.mark.parametrize("mode", ["on", "off"])
def test_forced_modes_never_probe(mode, trial_log, tmp_path):
    sched = FakeScheduler()
    trial_log.tiering = FakeTiering(mode)
    res = int4_probe.resolve_engine_int4(trial_log.tiering, sched, FakeTokenizer(), cache_dir=tmp_path)
    assert res.enabled is (mode == "on") and res.source == mode and trial_log.calls == []


def test_policy_without_int4_skips_probe(trial_log, tmp_path):
    sched = FakeScheduler()
    trial_log.tiering = FakeTiering("auto", "pdtrim")
    res = int4_probe.resolve_engine_int4(trial_log.tiering, sched, FakeTokenizer(), cache_dir=tmp_path)
    assert (res.enabled, res.source, trial_log.calls) == (False, "unused", [])


@pytest.mark.parametrize("correct,enabled", [({0, 1, 2}, True), ({0, 2}, True), ({1}, False), (set(), False)])
def test_auto_probes_under_probe_settings_then_caches(correct, enabled, trial_log, tmp_path):
    sched = FakeScheduler()
    trial_log.tiering, trial_log.correct = FakeTiering("auto"), correct
    res = int4_probe.resolve_engine_int4(trial_log.tiering, sched, FakeTokenizer(), cache_dir=tmp_path)
    assert (res.enabled, res.source, len(trial_log.calls), sched.flushes) == (enabled, "probe", 3, 1)
    probe_settings = {"policy": "greedy", "budget": 0.3, "unit": "cost", "int4_allowed": True}
    assert all(c == probe_settings for c in trial_log.calls)
    assert trial_log.tiering.settings["budget"] == 0.5  # restored after the probe
    again = int4_probe.resolve_engine_int4(trial_log.tiering, sched, FakeTokenizer(), cache_dir=tmp_path)
    assert (again.enabled, again.source, len(trial_log.calls)) == (enabled, "cache", 3)


@pytest.mark.slow
def test_engine_start_applies_probe_decision(smollm2_path, trial_log, tmp_path, monkeypatch):
    from sgl_kvxfer import Engine

    monkeypatch.setenv("SGL_KVXFER_PROBE_CACHE", str(tmp_path))
    trial_log.correct = set()  # every trial fails: int4 off, 2-tier stores

    class Spy:  # the real EngineTiering settings, read when a trial runs
        settings = {}
    trial_log.tiering = Spy
    kw = dict(max_total_tokens=8000, dtype="bfloat16", kv_tier_budget=0.4, kv_int4="auto")
    with Engine(smollm2_path, **kw) as eng:
        tiering = eng.scheduler.tiering
        info = eng.get_server_info()["extra"]
        assert (info["kv_int4_enabled"], info["kv_int4_source"]) == (False, "probe")
        assert eng.runner.kv_pool.plan.n4 == 0 and eng.runner.kv_pool.plan.n8 > 0
        eng.generate("The quick brown fox jumps over the lazy dog. " * 10, {"max_new_tokens": 0})
        assert tiering.records[-1].got[2] == 0 and tiering.records[-1].got[3] > 0  # 2-tier: int8 + drop
        eng.scheduler.kv.allocator.debug_check()
    with Engine(smollm2_path, **kw) as eng:
        assert eng.get_server_info()["extra"]["kv_int4_source"] == "cache"
    assert len(trial_log.calls) == 3


def test_probe_trial_length_follows_config_and_keys_the_cache(trial_log, tmp_path, monkeypatch):
    """--kv-int4-probe-tokens sets the trials' length; a different length is a cache miss."""
    lengths = []
    real_build = int4_probe.build_probe_trials

    def spy_build(texts, num_trials, target_tokens, count_tokens=None):
        lengths.append(target_tokens)
        return real_build(texts, num_trials, target_tokens=target_tokens, count_tokens=count_tokens)

    monkeypatch.setattr(int4_probe, "build_probe_trials", spy_build)
    sched = FakeScheduler()
    for tokens, source in ((300, "probe"), (300, "cache"), (200, "probe")):
        trial_log.tiering = FakeTiering("auto")
        trial_log.tiering.config = EngineConfig(kv_tier_budget=0.5, kv_int4="auto", kv_int4_probe_tokens=tokens)
        res = int4_probe.resolve_engine_int4(trial_log.tiering, sched, FakeTokenizer(), cache_dir=tmp_path)
        assert res.source == source
    assert lengths == [300, 200]
    assert EngineConfig().kv_int4_probe_tokens == 1024
    with pytest.raises(ValueError, match="kv_int4_probe_tokens"):
        EngineConfig(kv_int4_probe_tokens=10)
