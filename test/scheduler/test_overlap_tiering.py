"""Overlapped decode under SpectrumKV tiering (scheduler/overlap.py, EngineTiering.apply_drains):
forced on here on CPU (the forward is synchronous, the code path the same), it must give exactly
the plain scheduler's outputs and leave no KV slot behind, with decode demotion crossing several
R windows (b = 0.5 and 0.25, int stores paged 16 and 64), natural EOS and stop strings (a
request's final demotion runs behind the next step). With the cold tier promoting and landing,
a scoring pass runs with the next step in flight, so its promotions land one forward later than
in the plain scheduler: the overlapped run must give exactly the outputs and the picks of a plain
run whose passes, where the overlapped one's ran with a step in flight, land one step late. The
GPU tests run it on CUDA graphs."""
import random

import pytest

pytestmark = pytest.mark.slow

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
PROMPTS = [CHAT.format(q) for q in ("Say hi.", "Name a color.", "What is 2+2?", "Write a haiku about rain.",
                                     "List three fruits.", "Reply with one word: yes or no.")]
PROMPTS += ["def add(a, b):", "The capital of France is", "1, 2, 3, 4,",
            "The history of mathematics is long and full of surprising turns. " * 4]
# the torch backend at page 1: the tiered engine's configuration (config.py: tiering needs page 1)
KW = dict(max_total_tokens=12000, attention_backend="torch", kv_int4="on", kv_decode_recent=4)


def _params(i):
    p = {"max_new_tokens": 14 + 9 * (i % 4), "temperature": 0}
    if i == 2:
        p["stop"] = ["4"]  # finishes on a stop string (host-side check)
    if i == 7:
        p["min_new_tokens"] = 3  # not overlap-eligible for its first steps
    return p


class _Counts:
    """Spies on the scheduler: steps launched overlapped, steps drained, the work that must run
    with no later step in flight (a running request's demotion) seen with one in flight (`unsafe`;
    `_unapplied` holds the step being applied and, when overlapped, the one launched after it),
    and per cold-tier scoring pass call whether a later step was in flight (`passes`)."""

    def __init__(self, sched):
        self.followups, self.drains, self.unsafe, self.passes = 0, 0, 0, []
        launch, drain = sched._launch_followup, sched._drain
        tiering = sched.tiering
        demote = tiering._demote_runs

        def watched_demote(runs):
            if len(sched._unapplied) > 1 and any(req.finished_reason is None for req, _, _ in runs):
                self.unsafe += 1
            demote(runs)
        tiering._demote_runs = watched_demote
        if tiering.cold is not None:
            score = tiering.cold._score

            def watched_score(batch, due, held=None):
                self.passes.append(len(sched._unapplied) > 1)
                score(batch, due, held)
            tiering.cold._score = watched_score

        def counted_launch(prev):
            out = launch(prev)
            self.followups += out is not None
            return out

        def counted_drain():
            self.drains += 1
            drain()
        sched._launch_followup, sched._drain = counted_launch, counted_drain


def _run(engine, overlap: bool, params=None, prompts=PROMPTS, **kw):
    engine.scheduler.overlap = overlap
    params = params or [_params(i) for i in range(len(prompts))]
    if isinstance(prompts[0], str):
        res = engine.generate(prompts, params, **kw)
    else:
        res = engine.generate(input_ids=prompts, sampling_params=params, **kw)
    return [(r["output_ids"], r["meta_info"]["finish_reason"]) for r in res]


def _assert_no_leak(engine):
    sched = engine.scheduler
    assert engine.flush_cache()
    assert sched.inflight is None and not sched._unapplied
    alloc = engine.runner.allocator
    alloc.debug_check()
    assert sum(alloc.used_counts().values()) == 0  # every tier's slots back (fp16, int8, int4)


@pytest.mark.heavy  # over 10 s on 2 cores: CI leaves it out (README, Tests)
@pytest.mark.parametrize("budget,tier_page", [(0.5, 16), (0.25, 64)])
def test_tiered_overlap_matches_plain_and_frees_every_slot(smollm2_path, budget, tier_page):
    from sgl_kvxfer import Engine

    with Engine(smollm2_path, device="cpu", kv_tier_budget=budget, kv_tier_page_size=tier_page, **KW) as engine:
        tiering = engine.scheduler.tiering
        plain = _run(engine, overlap=False)
        n_plain = len(tiering.records)
        _assert_no_leak(engine)
        counts = _Counts(engine.scheduler)
        overlapped = _run(engine, overlap=True)
        assert overlapped == plain
        assert len(tiering.records) - n_plain == n_plain  # the same demotions (and prompt re-tiers)
        assert any(fr["type"] == "stop" for _, fr in plain)  # EOS / stop string: void tokens happened
        # R = 4: a demotion drains one step in four or so; the rest launch before the apply
        assert counts.drains >= 5 and counts.followups > 2 * counts.drains and not counts.unsafe, vars(counts)
        _assert_no_leak(engine)


def test_tiered_overlap_with_logprobs_and_disabled_overlap(smollm2_path):
    """Requests that ask for logprobs never overlap; overlap off (`--disable-overlap-schedule`
    on CUDA) runs the plain path: both as the plain scheduler."""
    from sgl_kvxfer import Engine

    params = [{"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}] * 4
    with Engine(smollm2_path, device="cpu", kv_tier_budget=0.5, **KW) as engine:
        plain = _run(engine, overlap=False, params=params, prompts=PROMPTS[:4], return_logprob=True)
        _assert_no_leak(engine)
        counts = _Counts(engine.scheduler)
        assert _run(engine, overlap=True, params=params, prompts=PROMPTS[:4], return_logprob=True) == plain
        assert counts.followups == 0
        _assert_no_leak(engine)
    with Engine(smollm2_path, device="cpu", kv_tier_budget=0.5, disable_overlap_schedule=True, **KW) as engine:
        assert not engine.scheduler.overlap and not engine.scheduler.chunk_overlap


def _record_picks(cold) -> list:
    """Every promotion the cold tier issues, as (prompt head, positions) in issue order."""
    picks, issue = [], cold._issue

    def recorded(batch, *args, **kwargs):
        picks.extend((tuple(req.origin_input_ids[:4]), positions.tolist()) for req, positions, _ in batch)
        return issue(batch, *args, **kwargs)
    cold._issue = recorded
    return picks


def _land_late(cold, late: list[bool]) -> None:
    """The plain scheduler with the landing of scoring pass call k put off to the next step's
    hooks (after that step's forward) where late[k]: what a pass run with the next step in flight
    does. Off CUDA the pass's copy is done at once, so on_decode's landing is what moves."""
    on_decode, land, calls = cold.on_decode, cold._land, iter(late)
    score = cold._score

    def counted(batch, due, held=None):
        cold._late = next(calls)
        return score(batch, due, held)

    def on_decode_late(batch):
        cold._late = False
        cold._land = lambda: None if cold._late else land()
        try:
            on_decode(batch)
        finally:
            cold._land = land
    cold._score, cold.on_decode = counted, on_decode_late


@pytest.mark.parametrize("interval", [2, 5])
def test_cold_tier_overlap_matches_plain_landing_one_step_late(tiny_preset_dir, interval):
    """The cold tier promotes (a low threshold on dummy weights), lands and gives rows back. A
    scoring pass does not drain its step: it reads the taps of its own step (copied before the
    next launch) with the next step in flight, and its promotions land one step later than the
    plain scheduler's. The reference is the plain scheduler with exactly those landings put off
    a step: same outputs, same picks in the same order, same counters."""
    from sgl_kvxfer import Engine

    rng = random.Random(0)
    ids = [[rng.randrange(3, 500) for _ in range(300)] for _ in range(3)]
    params = [{"max_new_tokens": 12 + 7 * i, "temperature": 0, "ignore_eos": True} for i in range(3)]
    kw = dict(load_format="dummy", dtype="bfloat16", device="cpu", attention_backend="torch", max_total_tokens=6000,
              kv_tier_budget=0.3, kv_int4="on", kv_decode_recent=8, kv_cold_tier=True, kv_promote_threshold=1e-3,
              kv_promote_interval=interval, kv_promote_radius=2)
    with Engine(tiny_preset_dir, **kw) as engine:
        cold = engine.scheduler.tiering.cold
        counts = _Counts(engine.scheduler)
        picks = _record_picks(cold)
        overlapped = _run(engine, overlap=True, params=params, prompts=ids)
        stats = dict(cold.stats)
        assert stats["promoted_tokens"] > 0 and stats["landed"] > 0
        # passes run with the next step in flight; only demotion drains
        assert sum(counts.passes) > 0 and counts.followups > 0 and not counts.unsafe, vars(counts)
        assert cold.server_info()["pending"] == 0
        _assert_no_leak(engine)
        assert cold.store.rows_in_use == 0  # host copies (int4 ids, dropped tokens) die with their ids / rows
    with Engine(tiny_preset_dir, **kw) as engine:
        cold = engine.scheduler.tiering.cold
        ref_picks = _record_picks(cold)
        _land_late(cold, counts.passes)
        assert _run(engine, overlap=False, params=params, prompts=ids) == overlapped
        assert ref_picks == picks and len(picks) > 0
        keys = ("scoring_passes", "promotions", "promoted_tokens", "landed", "stale", "repacked_tokens")
        assert {k: cold.stats[k] for k in keys} == {k: stats[k] for k in keys}
        _assert_no_leak(engine)


@pytest.mark.gpu
@pytest.mark.parametrize("budget,cold", [(0.5, False), (0.25, True)])
def test_tiered_overlap_on_cuda_graphs(smollm2_path, budget, cold):
    """CUDA, bf16, CUDA graphs, tiered: with fixed lengths the overlapped run reproduces the plain
    one token for token, through demotions every R = 4 steps and (cold) cold-tier scoring passes
    (at a threshold nothing reaches: nothing lands, so both runs read the same KV; the passes run
    with the next step in flight); with natural EOS every slot comes back."""
    import torch

    from sgl_kvxfer import Engine

    if not torch.cuda.is_available():
        pytest.skip("CUDA only")
    with Engine(smollm2_path, device="cuda", dtype="bfloat16", max_total_tokens=20000, kv_tier_budget=budget,
                kv_int4="on", kv_decode_recent=4, kv_cold_tier=cold, kv_promote_interval=8) as engine:
        sched = engine.scheduler
        if cold:
            sched.tiering.cold.threshold = 1.0 + 1e-6  # no probability reaches it (the config caps it at 1)
        assert sched.overlap and sched.tiering is not None and engine.runner.graph_runner is not None
        fixed = [{"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}] * len(PROMPTS)
        plain = _run(engine, False, fixed)
        _assert_no_leak(engine)
        counts = _Counts(sched)
        assert _run(engine, True, fixed) == plain
        assert counts.drains > 0 and counts.followups > counts.drains and not counts.unsafe, vars(counts)
        assert not cold or sum(counts.passes) > 0, vars(counts)  # passes ran with a step in flight
        _assert_no_leak(engine)
        _run(engine, True)
        _assert_no_leak(engine)


@pytest.mark.gpu
@pytest.mark.parametrize("budget,cold", [(0.5, False), (0.25, True)])
def test_tiered_overlap_on_cuda_graphs_dummy_weights(tiny_preset_dir, budget, cold):
    """The CUDA-graph case above on random weights (no model files needed on the GPU host): the
    overlapped run reproduces the plain one token for token through demotions every R = 4 steps
    and, with the cold tier, its scoring passes beside the next forward; every slot comes back."""
    import torch

    from sgl_kvxfer import Engine

    if not torch.cuda.is_available():
        pytest.skip("CUDA only")
    rng = random.Random(1)
    ids = [[rng.randrange(3, 500) for _ in range(200 + 37 * i)] for i in range(6)]
    fixed = [{"max_new_tokens": 40 + 3 * i, "temperature": 0, "ignore_eos": True} for i in range(6)]
    with Engine(tiny_preset_dir, load_format="dummy", device="cuda", dtype="bfloat16", attention_backend="triton",
                max_total_tokens=20000,
                kv_tier_budget=budget, kv_int4="on", kv_decode_recent=4, kv_cold_tier=cold,
                kv_promote_interval=8) as engine:
        sched = engine.scheduler
        if cold:
            sched.tiering.cold.threshold = 1.0 + 1e-6  # nothing lands: both runs read the same KV
        assert sched.overlap and sched.tiering is not None and engine.runner.graph_runner is not None
        plain = _run(engine, False, fixed, prompts=ids)
        _assert_no_leak(engine)
        counts = _Counts(sched)
        assert _run(engine, True, fixed, prompts=ids) == plain
        assert counts.drains > 0 and counts.followups > counts.drains and not counts.unsafe, vars(counts)
        assert not cold or sum(counts.passes) > 0, vars(counts)  # passes ran with a step in flight
        _assert_no_leak(engine)


@pytest.mark.gpu
def test_cold_tier_promotes_beside_the_next_forward_on_cuda_graphs(tiny_preset_dir):
    """CUDA graphs, random weights, a threshold low enough to promote: scoring passes run with
    the next step in flight (the held taps, the scoring stream), their promotions are issued and
    land, and every slot and host copy comes back. Landing timing depends on the copy thread, so
    outputs are not compared with the plain scheduler's here (the CPU test pins the picks)."""
    import torch

    from sgl_kvxfer import Engine

    if not torch.cuda.is_available():
        pytest.skip("CUDA only")
    rng = random.Random(2)
    ids = [[rng.randrange(3, 500) for _ in range(300 + 41 * i)] for i in range(4)]
    params = [{"max_new_tokens": 30 + 5 * i, "temperature": 0, "ignore_eos": True} for i in range(4)]
    with Engine(tiny_preset_dir, load_format="dummy", device="cuda", dtype="bfloat16", attention_backend="triton",
                max_total_tokens=20000, kv_tier_budget=0.3, kv_int4="on", kv_decode_recent=8, kv_cold_tier=True,
                kv_promote_threshold=1e-3, kv_promote_interval=2, kv_promote_radius=2) as engine:
        sched = engine.scheduler
        cold = sched.tiering.cold
        assert sched.overlap and engine.runner.graph_runner is not None
        counts = _Counts(sched)
        out = _run(engine, True, params, prompts=ids)
        assert [len(o) for o, _ in out] == [p["max_new_tokens"] for p in params]
        assert sum(counts.passes) > 0 and counts.followups > 0 and not counts.unsafe, vars(counts)
        assert cold.stats["promoted_tokens"] > 0 and cold.stats["landed"] > 0, cold.stats
        assert cold.server_info()["pending"] == 0
        _assert_no_leak(engine)
        assert cold.store.rows_in_use == 0
