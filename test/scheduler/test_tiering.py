"""SpectrumKV through the real engine (SmolLM2-135M, bf16 on CPU so bytes are literal)."""

import pytest
import torch

from sgl_kvxfer.spectrum.niah import load_filler_texts
from sgl_kvxfer.spectrum.tiers import TIER_DROP

pytestmark = pytest.mark.slow
SHORT = {"max_new_tokens": 8, "temperature": 0}
# the torch backend: the untiered reference (bf16 CPU would default to the `cpu` backend, whose
# 16-slot pages make prefix hits page-granular; the protocol below caches a 600-token context)
KW = dict(max_total_tokens=12000, dtype="bfloat16", attention_backend="torch")


@pytest.fixture(scope="module")
def base(smollm2_path):
    from sgl_kvxfer import Engine

    with Engine(smollm2_path, **KW) as eng:
        yield eng


@pytest.fixture(scope="module")
def tiered(smollm2_path):
    from sgl_kvxfer import Engine

    with Engine(smollm2_path, kv_tier_budget=0.5, kv_int4="on", kv_decode_recent=16, chunked_prefill_size=128,
                **KW) as eng:
        yield eng


@pytest.fixture(scope="module")
def prose(base):
    text = load_filler_texts()[3]
    return base.tokenizer.encode(text)[:701]


def continuation_nll(engine, ctx, cont):
    """Compressed-prefix protocol: cache ctx (tiered), then score cont against it."""
    engine.flush_cache()
    engine.generate(input_ids=ctx, sampling_params={"max_new_tokens": 0})
    out = engine.generate(input_ids=ctx + cont, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                          logprob_start_len=len(ctx))
    assert out["meta_info"]["cached_tokens"] == len(ctx)
    lps = [e[0] for e in out["meta_info"]["input_token_logprobs"] if e[0] is not None]
    return -sum(lps) / len(lps)


def test_b1_is_the_untiered_engine(smollm2_path, base, tiered):
    from sgl_kvxfer import Engine

    prompts = ["The capital of France is", "def fibonacci(n):"]
    with Engine(smollm2_path, kv_tier_budget=1.0, **KW) as b1:
        assert b1.scheduler.tiering is None and not b1.runner.kv_pool.drops_tokens
        assert [o["output_ids"] for o in b1.generate(prompts, SHORT)] == \
            [o["output_ids"] for o in base.generate(prompts, SHORT)]
    # The tiered pool itself is exact when the policy keeps everything fp16.
    with tiered.scheduler.tiering.using(budget=1.0):
        tiered.flush_cache()
        assert [o["output_ids"] for o in tiered.generate(prompts, SHORT)] == \
            [o["output_ids"] for o in base.generate(prompts, SHORT)]


def test_b05_shrinks_resident_kv_and_stays_close(base, tiered, prose):
    ctx, cont = prose[:600], prose[600:]
    ref = continuation_nll(base, ctx, cont)
    got = continuation_nll(tiered, ctx, cont)
    assert abs(got - ref) / ref < 0.02, (got, ref)
    info = tiered.get_server_info()
    ratio = info["kv_bytes_per_token"] / info["extra"]["kv_full_bytes_per_token"]
    assert ratio <= 0.53, ratio  # everything resident is tiered: context + scored continuation
    first = [r for r in tiered.scheduler.tiering.records if r.start == 0][-1]
    assert first.end == 600 and first.byte_ratio <= 0.5 and first.asked == first.got
    out_b = base.generate(input_ids=prose[:300], sampling_params=SHORT)
    out_t = tiered.generate(input_ids=prose[:300], sampling_params=SHORT)
    assert out_t["meta_info"]["completion_tokens"] == 8 and out_t["output_ids"][:4] == out_b["output_ids"][:4]


def test_tier_maps_only_on_request(tiered, prose):
    tiering = tiered.scheduler.tiering
    tiered.flush_cache()
    tiered.generate(input_ids=prose[:200], sampling_params=SHORT)
    assert [r for r in tiering.records if r.start == 0][-1].tier_map is None  # off by default
    tiering.keep_tier_maps = True
    try:
        tiered.flush_cache()
        tiered.generate(input_ids=prose[:300], sampling_params=SHORT)
    finally:
        tiering.keep_tier_maps = False
    first = [r for r in tiering.records if r.start == 0][-1]
    assert first.tier_map.numel() == first.end - first.start == 300
    assert torch.bincount(first.tier_map.long(), minlength=4).tolist() == list(first.got)


def test_radix_hit_reuses_tiered_prefix(tiered, prose):
    tiering, tree = tiered.scheduler.tiering, tiered.scheduler.kv.tree
    tiered.flush_cache()
    ctx = prose[:400]
    tiered.generate(input_ids=ctx, sampling_params={"max_new_tokens": 0})
    slots, node = tree.match_prefix(ctx)
    tiers = tree.match_tiers(node).clone()
    assert slots.numel() == 400 and set(tiers.tolist()) <= {0, 1, 2} and (tiers > 0).sum() > 350
    n_records = len(tiering.records)
    out = tiered.generate(input_ids=ctx + prose[400:450], sampling_params=SHORT)
    assert out["meta_info"]["cached_tokens"] == 400
    new = list(tiering.records)[n_records:]
    assert new[0].start == 400  # only the private tail was assigned; the prefix kept its tiers
    slots2, node2 = tree.match_prefix(ctx)
    assert torch.equal(slots2, slots) and torch.equal(tree.match_tiers(node2), tiers)


def test_chunked_prefill_feeds_importance(tiered, prose, monkeypatch):
    """128-token chunks of a 400-token prompt: the window [368, 400) straddles the last two
    chunks, and both must feed the accumulator (all 30 layers x 9 heads x 32 queries)."""
    from sgl_kvxfer.scheduler import tiering as tiering_mod

    made = []

    class Spy(tiering_mod.ImportanceAccumulator):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    def no_fallback(slots):
        raise AssertionError("attention importance missing: fell back to KV norms")

    tiering = tiered.scheduler.tiering
    monkeypatch.setattr(tiering_mod, "ImportanceAccumulator", Spy)
    monkeypatch.setattr(tiering, "_norm_importance", no_fallback)
    tiered.flush_cache()
    with tiering.using(policy="sws"):  # sws ranks purely by importance
        tiered.generate(input_ids=prose[:400], sampling_params={"max_new_tokens": 0})
    assert len(made) == 1 and made[0].num_rows == 32 * 9 * 30
    tree = tiered.scheduler.kv.tree
    tiers = tree.match_tiers(tree.match_prefix(prose[:400])[1])
    assert (tiers == TIER_DROP).sum() == 200 and tiers[-1] != TIER_DROP and tiers[0] != TIER_DROP


def test_pdtrim_drops_are_masked(tiered):
    import random

    rng = random.Random(0)
    filler, needle, tail = ([rng.randrange(1000, 20000) for _ in range(200)] for _ in range(3))
    ctx, cont = filler + needle + tail, needle[:61]
    keep = continuation_nll(tiered, ctx, cont)
    with tiered.scheduler.tiering.using(policy="pdtrim"):
        dropped = continuation_nll(tiered, ctx, cont)
        slots, _ = tiered.scheduler.kv.tree.match_prefix(ctx)
        assert int((slots == 0).sum()) == 300  # the middle half is slot 0 (masked) in the cache
    assert dropped > keep + 2.0, (dropped, keep)  # the copied span was removed, not zeroed
    tiered.scheduler.kv.allocator.debug_check()


def test_decode_demotion_keeps_recent_window(tiered, prose):
    tiering = tiered.scheduler.tiering
    tiered.flush_cache()
    n_records = len(tiering.records)
    with tiering.using(decode_recent=4):
        out = tiered.generate(input_ids=prose[:100], sampling_params={"max_new_tokens": 20, "temperature": 0,
                                                                      "ignore_eos": True})
    runs = [(r.start, r.end) for r in list(tiering.records)[n_records:] if r.start >= 100]
    # R = 4: runs of 4 while decoding (each time 8 are unassigned), then all but the last 4 at finish
    kv_len = 100 + 20 - 1
    assert runs[0] == (100, 104) and runs[-1][1] == kv_len - 4, runs
    assert all(b - a == 4 for a, b in runs[:-1]) and all(r.asked == r.got for r in tiering.records)
    assert out["meta_info"]["completion_tokens"] == 20
    tree = tiered.scheduler.kv.tree
    tiers = tree.match_tiers(tree.match_prefix(prose[:100] + out["output_ids"][:-1])[1])
    assert (tiers[100:kv_len - 4] > 0).all() and (tiers[kv_len - 4:] == 0).all()  # window cached fp16
    tiered.scheduler.kv.allocator.debug_check()


def test_decode_demotion_runs_on_host_ids(tiered, prose, monkeypatch):
    """Each demotion reads the device table once per due run (its tails are checked on that
    copy, not read back per tier), scores all layers through the stacked rows, and the pages
    its runs continue are the tails the previous run left."""
    tiering = tiered.scheduler.tiering
    table, reads, calls, stacked, live = tiering.table, [0], [], [], []
    read = table.read

    def counted_read(*a, **kw):
        reads[0] += 1
        return read(*a, **kw)

    demote, norms, tails = tiering._demote_runs, tiering._stacked_norms, tiering._live_tails

    def counted_demote(runs):
        before = reads[0]
        demote(runs)
        calls.append((len(runs), reads[0] - before))

    def seen_norms(slots):
        out = norms(slots)
        stacked.append(out is not None)
        return out

    def seen_tails(req, row, lo):
        out = tails(req, row, lo)
        live.append(out)
        return out

    monkeypatch.setattr(table, "read", counted_read)
    monkeypatch.setattr(tiering, "_demote_runs", counted_demote)
    monkeypatch.setattr(tiering, "_stacked_norms", seen_norms)
    monkeypatch.setattr(tiering, "_live_tails", seen_tails)
    tiered.flush_cache()
    with tiering.using(decode_recent=4):
        tiered.generate(input_ids=[prose[:100], prose[100:190]],
                        sampling_params={"max_new_tokens": 24, "temperature": 0, "ignore_eos": True})
    assert calls and all(n_reads == n_runs for n_runs, n_reads in calls), calls
    assert any(n_runs == 2 for n_runs, _ in calls)  # both requests demoted in one call
    assert stacked and all(stacked)  # decode runs are fp16 ids: the stacked pass
    assert any(t for t in live)  # a later run continued its previous run's page
    tiered.scheduler.kv.allocator.debug_check()


def test_stacked_norms_equal_the_per_layer_pass(tiered):
    """_stacked_norms sums the per-layer KVNormAccumulator norms in one reduction: equal to
    float32 rounding; int ids take the per-layer path (None)."""
    from sgl_kvxfer.spectrum.importance import KVNormAccumulator

    tiering = tiered.scheduler.tiering
    pool = tiering.pool
    g = torch.Generator().manual_seed(0)
    slots = torch.randint(1, pool.num_slots(0), (37,), generator=g)
    saved = [(x, x[slots].clone()) for x in (pool.k16[0], pool.v16[1])]
    for x, _ in saved:  # rows with data in them (restored below)
        x[slots] = torch.randn(x[slots].shape, generator=g).to(x.dtype)
    try:
        acc = KVNormAccumulator(slots.numel())
        for layer in range(pool.num_layers):
            acc.add_layer(pool.k16[layer][slots], pool.v16[layer][slots])
        got = tiering._stacked_norms(slots)
        torch.testing.assert_close(got, acc.totals(), rtol=1e-6, atol=0)
        tiering._NORM_CHUNK_BYTES = 1  # one layer per gather: the same sums
        try:
            torch.testing.assert_close(tiering._stacked_norms(slots), acc.totals(), rtol=1e-6, atol=0)
        finally:
            del tiering._NORM_CHUNK_BYTES
        assert tiering._stacked_norms(torch.tensor([1, pool.base(1)])) is None
    finally:
        for x, old in saved:
            x[slots] = old
