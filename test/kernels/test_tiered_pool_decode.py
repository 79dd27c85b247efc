"""tiered_pool_decode (the decode over the engine's TieredKVPool) vs its torch reference.

Filled and dense tables, per-tier page sizes (the engine's fp16 rows at PAGE 1 beside int8 / int4
page-head blocks), partial and empty pages anywhere in a table, pages larger than the tile, odd
lengths, GQA 1 / 3 / 4, head dims 32 / 64 / 128, folded scales (G = D) and per-group dequantization
(G < D), splits 1-5 with the fused and the separate merge, tier subsets, empty requests, bf16,
int8 tensor cores for q . K. CPU: Triton interpreter at tiny shapes; GPU (-m gpu): real shapes."""
import pytest
import torch

from sgl_kvxfer.kernels.testing import TIER_ATOL, build_random_cache, build_random_paged_cache, exact_attention
from sgl_kvxfer.kernels.tiered_pool_decode import (
    DEFAULT_CONFIG, INTERPRET_CONFIG, TieredDecodeConfig, TieredDecodePlan, plan_tiered_pool_decode,
    SERVED_CONFIGS, SERVED_INT_PAGE, describe_served, qk_int8_rounded_q, served_config, served_int_page,
    tiered_pool_decode, tiered_pool_decode_reference, with_config,
)

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
BASE = DEFAULT_CONFIG if GPU else INTERPRET_CONFIG


def _plan(splits, B, Hkv, fused=True):
    return TieredDecodePlan(splits, torch.zeros(B * Hkv, dtype=torch.int32, device=DEV) if fused else None)


def _run(lens, Hq, Hkv, D, G, pages, dtype=torch.float16, filled=True, splits=None, fused=True, config=None,
         tiers=(0, 1, 2), seed=0):
    layer, tables = build_random_paged_cache(lens, Hkv, D, G, pages, dtype, DEV, seed=seed, filled=filled)
    g = torch.Generator().manual_seed(seed + 7)
    q = torch.randn(len(lens), Hq, D, generator=g).to(dtype).to(DEV)
    plan = None if splits is None else _plan(splits, len(lens), Hkv, fused)
    out = torch.full_like(q, float("nan"))  # every row must be written, padding rows too
    got = tiered_pool_decode(q, layer, tables, out=out, plan=plan, config=config or BASE, tiers=tiers)
    assert got.data_ptr() == out.data_ptr()
    if plan is not None and plan.counters is not None:
        assert bool((plan.counters == 0).all()), "the merging programs reset their counters"
    # qk_int8 (G = D): the int tiers attend with q rounded to int8 per head; the reference rounds
    # q the same way, so the tolerance stays that of every other config
    q_int = qk_int8_rounded_q(q) if (config or BASE).qk_int8 and G == D else None
    ref = tiered_pool_decode_reference(q, layer, tables, q_int=q_int)
    for b, lb in enumerate(lens):
        if sum(lb[t] for t in tiers) == 0:
            assert bool((got[b] == 0).all()), "a request with no token must give exactly 0"
    return got.float(), ref.float()


def _close(got, ref, dtype=torch.float16, tol=None):
    # folded scales skip the reference's fp16 rounding of each dequantized element, and P is
    # rounded to fp16 before P @ V: a few fp16 ulps of an O(1) output
    tol = tol or (2e-2 if dtype == torch.float16 else 4e-2)
    err = (got - ref).abs().max().item()
    assert err <= tol, f"max err {err:.3g} > {tol}"


@pytest.mark.parametrize("G", [64, 16])
@pytest.mark.parametrize("pages", [(1, 16, 16), (1, 32, 16), (16, 16, 64)])
def test_mixed_tiers_filled(G, pages):
    lens = [(5, 40, 23), (0, 17, 50), (30, 0, 0), (3, 9, 1)]
    _close(*_run(lens, 8, 2, 64, G, pages, splits=2))


@pytest.mark.parametrize("splits", [1, 2, 5, 7])  # 7 x 3 tiers: more partials than one merge step takes
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("prefetch", [True, False])
def test_splits_and_merges(splits, fused, prefetch):
    lens = [(21, 70, 45), (2, 3, 90), (0, 0, 0)]
    cfg = with_config(BASE, merge_prefetch=prefetch)
    _close(*_run(lens, 4, 1, 32, 32, (1, 16, 32), splits=splits, fused=fused, config=cfg))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("prefetch", [True, False])
def test_empty_splits_partials_may_hold_nan(monkeypatch, fused, prefetch):
    """The merge loads every partial beside its lse: an empty split's partial, never written, may
    hold anything (torch.empty) and must not reach the output."""
    empty = torch.empty

    def nan_empty(*shape, **kw):
        x = empty(*shape, **kw)
        return x.fill_(float("nan")) if x.dtype == torch.float32 and x.dim() == 4 else x

    monkeypatch.setattr(torch, "empty", nan_empty)
    lens = [(3, 20, 17), (0, 40, 0), (1, 0, 0)]  # most of the 7 x 3 splits are empty
    got, ref = _run(lens, 4, 1, 32, 32, (1, 16, 16), splits=7, fused=fused,
                    config=with_config(BASE, merge_prefetch=prefetch))
    assert bool(torch.isfinite(got).all())
    _close(got, ref)


@pytest.mark.parametrize("Hq,Hkv", [(2, 2), (9, 3), (8, 2)])  # GQA 1, 3, 4
def test_gqa_ratios(Hq, Hkv):
    _close(*_run([(13, 31, 17), (1, 0, 33)], Hq, Hkv, 64, 64, (1, 16, 16), splits=2))


def test_head_dim_128_and_odd_lengths():
    _close(*_run([(7, 33, 19), (1, 1, 1)], 4, 1, 128, 128, (1, 16, 16), splits=2))


def test_dense_tables_and_page_boundaries():
    # lengths on, one past and one short of page boundaries, dense form
    lens = [(16, 32, 16), (17, 33, 15), (15, 31, 17)]
    _close(*_run(lens, 4, 2, 32, 32, (16, 16, 16), filled=False, splits=3))


# each knob in both states, each split count with a filled and an unfilled table (the full
# product adds interpreter minutes to CI and no path these do not take)
@pytest.mark.parametrize("row_splits,filled,splits", [(True, True, 3), (True, False, 7), (False, True, 7),
                                                      (False, False, 3)])
def test_row_splits_cut_the_fp16_rows_anywhere(row_splits, filled, splits):
    """fp16 rows (PAGE 1) and 4-slot pages under a 16-row tile, split at slot granularity (cuts
    inside steps and pages, splits shorter than a step, empty splits past a short request) or at
    step granularity; int tiers beside them keep their step splits."""
    cfg = with_config(BASE, tile16=16, row_splits=row_splits)
    lens = [(37, 20, 5), (5, 0, 17), (0, 3, 0), (16, 0, 0)]
    for pages in ((1, 16, 16), (4, 16, 16)):
        _close(*_run(lens, 4, 2, 32, 32, pages, filled=filled, splits=splits, config=cfg))


@pytest.mark.parametrize("tile", [16, 32])
def test_pages_larger_than_the_tile(tile):
    cfg = with_config(BASE, tile8=tile, tile4=tile, tile16=tile)
    _close(*_run([(40, 100, 70), (3, 64, 1)], 4, 2, 32, 32, (64, 64, 64), splits=2, config=cfg))


@pytest.mark.parametrize("tile", [32, 64])
@pytest.mark.parametrize("filled", [True, False])
def test_steps_over_several_pages(tile, filled):
    """Int pages smaller than the tile: tile / PAGE listed pages a step, each with its own fill."""
    cfg = with_config(BASE, tile8=tile, tile4=tile, tile16=tile)
    _close(*_run([(9, 100, 70), (3, 33, 1), (0, 16, 48)], 4, 2, 32, 32, (1, 16, 16), filled=filled, splits=2,
                 config=cfg))


@pytest.mark.parametrize("knobs", [dict(dot_cvt=True), dict(dot_cvt=True, sub_cvt=True),
                                   dict(dot_cvt=True, sub_cvt=True, qk_int8=True)])
@pytest.mark.parametrize("tile", [16, 32])
def test_codes_converted_in_the_dot_layout(knobs, tile):
    """dot_cvt (K read transposed, int4 high nibbles as 16 * hi) and sub_cvt (codes as fp16
    subnormals c * 2^-24): the factors taken out again give the same attention, with one page a
    step and with several (tile 32 over 16-token pages)."""
    cfg = with_config(BASE, tile8=tile, tile4=tile, tile16=tile, **knobs)
    lens = [(9, 100, 70), (3, 33, 1), (0, 16, 48)]
    _close(*_run(lens, 4, 2, 32, 32, (1, 16, 16), splits=2, config=cfg))
    _close(*_run([(5, 40, 23), (30, 0, 0)], 8, 2, 64, 64, (1, 16, 16), splits=1, config=cfg))


@pytest.mark.parametrize("tiers", [(1,), (2,), (0,), (1, 2), (0, 2)])
def test_tier_subsets_and_direct_write(tiers):
    """Only the listed tiers are read; the others hold no token. One tier, one split: the kernel
    writes o itself (no partial, no merge)."""
    lens = [tuple(n if t in tiers else 0 for t, n in enumerate(l)) for l in [(9, 40, 37), (0, 0, 0), (3, 1, 2)]]
    for splits in (1, 3):
        _close(*_run(lens, 4, 2, 32, 32, (1, 16, 16), splits=splits, tiers=tiers))


def _one_launch_only(monkeypatch):
    """The per-tier kernels must not run: one_launch covers the call alone."""
    from sgl_kvxfer.kernels import tiered_pool_decode as mod

    class NotLaunched:
        def __getitem__(self, grid):
            raise AssertionError("a per-tier kernel launched under one_launch")

    monkeypatch.setattr(mod, "_fp16_tier_kernel", NotLaunched())
    monkeypatch.setattr(mod, "_int_tier_kernel", NotLaunched())


@pytest.mark.parametrize("splits,fused,filled", [(1, True, True), (1, False, False), (2, True, False),
                                                 (2, False, True), (5, True, True), (5, False, False)])
def test_one_launch_byte_shares(monkeypatch, splits, fused, filled):
    """one_launch: one grid over every tier, each program a byte share of its request's steps
    (shares that cut inside a tier, empty shares, requests with an empty tier or no token)."""
    _one_launch_only(monkeypatch)
    cfg = with_config(BASE, one_launch=True)
    lens = [(21, 70, 45), (2, 3, 90), (0, 0, 0), (37, 0, 5), (0, 17, 0)]
    for pages in ((1, 16, 16), (4, 16, 32)):
        _close(*_run(lens, 4, 2, 32, 32, pages, splits=splits, fused=fused, filled=filled, config=cfg))


_KNOBS = [dict(), dict(dot_cvt=True), dict(dot_cvt=True, sub_cvt=True), dict(tile8=32, tile4=32, tile16=32)]


# every knob set over all three tiers, and each tier subset under a different knob set
@pytest.mark.parametrize("knobs,tiers", [(k, (0, 1, 2)) for k in _KNOBS]
                         + [(_KNOBS[1], (1, 2)), (_KNOBS[2], (0, 1)), (_KNOBS[3], (0, 2)), (_KNOBS[0], (1, 2))])
def test_one_launch_tiers_and_conversions(monkeypatch, knobs, tiers):
    """one_launch over tier subsets, the dot-layout conversions, and steps of several pages (tile
    32 over 16-token pages) or inside one (64-token pages)."""
    _one_launch_only(monkeypatch)
    cfg = with_config(BASE, one_launch=True, **knobs)
    lens = [tuple(n if t in tiers else 0 for t, n in enumerate(l)) for l in [(9, 100, 70), (3, 33, 1), (0, 16, 48)]]
    for pages in ((1, 16, 16), (16, 64, 64)):
        _close(*_run(lens, 8, 2, 64, 64, pages, splits=2, config=cfg, tiers=tiers))


def test_one_launch_bf16_and_fallbacks():
    """bf16 q; G < D and qk_int8 take the per-tier launches (one_launch covers G = D, fp16 q . K)."""
    cfg = with_config(BASE, one_launch=True)
    lens = [(5, 40, 23), (30, 0, 0), (1, 2, 3)]
    _close(*_run(lens, 8, 2, 64, 64, (1, 16, 16), dtype=torch.bfloat16, splits=3, config=cfg), torch.bfloat16)
    _close(*_run(lens, 8, 2, 64, 16, (1, 16, 16), splits=3, config=cfg))
    _close(*_run(lens, 8, 2, 64, 64, (1, 16, 16), splits=3, config=with_config(cfg, qk_int8=True)))


def test_empty_tiers_and_requests():
    for lens in ([(0, 40, 0), (0, 0, 0)], [(0, 0, 37), (0, 0, 0)], [(0, 0, 0)]):
        _close(*_run(lens, 4, 2, 32, 32, (1, 16, 16), splits=3))


@pytest.mark.parametrize("G", [32, 8])
def test_bf16(G):
    _close(*_run([(9, 40, 23), (2, 0, 17)], 6, 2, 32, G, (1, 16, 16), dtype=torch.bfloat16, splits=2),
           torch.bfloat16)


def test_qk_int8():
    """q quantized per head to int8 for q . K on int8 tensor cores: the attention of that rounded q
    over the int tiers (the reference rounds q the same way), q itself over the fp16 tier."""
    cfg = with_config(BASE, qk_int8=True)
    q = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(7)).half()
    assert not torch.equal(qk_int8_rounded_q(q), q.float()), "the rounding must move q"
    _close(*_run([(7, 33, 20), (16, 16, 16)], 8, 2, 64, 64, (1, 16, 32), splits=2, config=cfg))


def _poison_dead_slots(layer, tables):
    """NaN where the kernels read but must not use (they load codes, scales and K / V rows without
    the fill masks): every int scale / zero of a slot no request reads (past a page's fill, pages no
    request lists), and every fp16 value of a page no request lists. The fp16 tier's contract is
    narrower: every slot of a listed page holds finite values (its V rows meet P @ V whole)."""
    for t in (0, 1, 2):
        tp, P = layer[t], layer.page_size_of(t)
        live = torch.zeros(tp.k.shape[0], P, dtype=torch.bool)
        bt, fl, npg = (x.cpu() for x in (tables.tables[t], tables.fills[t], tables.num_pages[t]))
        for b in range(bt.shape[0]):
            for j in range(int(npg[b])):
                live[int(bt[b, j]), :max(int(fl[b, j]), P if t == 0 else 0)] = True
        dead = (~live).to(tp.k.device)
        views = (tp.k, tp.v) if t == 0 else (tp.k_scale, tp.k_zero, tp.v_scale, tp.v_zero)
        for x in views:  # [pages, Hkv, PAGE, X]: write through the slot-major view
            x.permute(0, 2, 1, 3)[dead] = float("nan")
        assert bool(dead.any()), f"tier {t}: the layout must have dead slots to poison"


@pytest.mark.parametrize("pages,tile", [((1, 16, 16), 16), ((1, 16, 16), 32), ((16, 32, 16), 16)])
def test_dead_slots_may_hold_nan(pages, tile):
    """What the kernels read but must not use may hold NaN (_poison_dead_slots) without changing the
    output: steps of one page and of several, the fp16 rows' gather and fp16 pages."""
    cfg = with_config(BASE, tile8=tile, tile4=tile, tile16=tile)
    lens = [(5, 40, 23), (0, 17, 50), (30, 0, 0), (3, 9, 1)]
    layer, tables = build_random_paged_cache(lens, 2, 64, 64, pages, torch.float16, DEV, seed=5)
    _poison_dead_slots(layer, tables)
    q = torch.randn(len(lens), 8, 64, generator=torch.Generator().manual_seed(9)).half().to(DEV)
    got = tiered_pool_decode(q, layer, tables, plan=_plan(2, len(lens), 2), config=cfg)
    ref = tiered_pool_decode_reference(q, layer, tables)
    assert not bool(ref.isnan().any()), "the reference reads live slots only"
    _close(got.float(), ref.float())


def test_matches_exact_attention_on_the_originals():
    """What the tiers cost: the kernel against attention over the unquantized K/V."""
    for mix, lens in (("int8", [(0, 40, 0), (0, 3, 0)]), ("int4", [(0, 0, 33), (0, 0, 16)]),
                      ("fp16", [(37, 0, 0), (5, 0, 0)]), ("mixed", [(17, 5, 40), (1, 33, 2)])):
        layer, tables, (k, v) = build_random_cache(lens, 2, 32, 32, 16, device=DEV, seed=len(lens))
        q = torch.randn(len(lens), 4, 32, generator=torch.Generator().manual_seed(3)).half().to(DEV)
        o = tiered_pool_decode(q, layer, tables, plan=_plan(2, len(lens), 2), config=BASE)
        err = (o.float() - exact_attention(q, k, v, lens, 2)).abs().max().item()
        assert err < TIER_ATOL[mix], (mix, err)


def test_plan_and_config():
    plan = plan_tiered_pool_decode(1, 8, 32768, "cpu", with_config(DEFAULT_CONFIG, split_waves=2))
    assert plan.num_splits == 1  # 4 "SMs" on CPU: 8 programs per wave of 2 per SM -> 1
    assert plan_tiered_pool_decode(1, 3, 32768, "cpu", with_config(DEFAULT_CONFIG, split_waves=2)).num_splits == 2
    plan = plan_tiered_pool_decode(1, 1, 100000, "cpu", with_config(DEFAULT_CONFIG, split_waves=4))
    assert plan.num_splits == 16 and plan.counters.shape == (1,)
    assert plan_tiered_pool_decode(1, 1, 1000, "cpu", DEFAULT_CONFIG).num_splits == 1  # < 2 x min_split_tokens
    assert plan_tiered_pool_decode(2, 1, 9000, "cpu", with_config(DEFAULT_CONFIG, fused_merge=False)).counters is None
    for bad in (dict(tile8=24), dict(tile4=8), dict(warps16=3), dict(stages8=0), dict(split_waves=0),
                dict(min_split_tokens=0)):
        with pytest.raises(ValueError):
            TieredDecodeConfig(**bad)
    assert DEFAULT_CONFIG.launch(1) == (DEFAULT_CONFIG.tile8, DEFAULT_CONFIG.warps8, DEFAULT_CONFIG.stages8)


def test_min_steps_halves_short_splits():
    cfg = with_config(DEFAULT_CONFIG, tile16=128, warps16=8, tile4=256, warps4=4, min_steps=8)
    assert cfg.launch(0) == (128, 8, cfg.stages16)  # no split size: as configured
    assert cfg.launch(0, 8192) == (128, 8, cfg.stages16)  # 64 steps
    assert cfg.launch(0, 993) == (128, 8, cfg.stages16)  # the fp16 tier keeps its tile
    assert cfg.launch(1, 993) == (64, 4, cfg.stages8)  # 3.9 steps of 256 -> 15.5 of 64
    assert cfg.launch(2, 993) == (64, 4, cfg.stages4)  # 256 -> 128 -> 64, never below 64 or 4 warps
    assert cfg.launch(2, 10) == (64, 4, cfg.stages4)
    assert with_config(cfg, min_steps=0).launch(2, 10) == (256, 4, cfg.stages4)
    with pytest.raises(ValueError):
        with_config(cfg, min_steps=-1)


def test_min_steps_launch_matches_the_reference():
    """A launch whose int tiles min_steps halves (128 -> 64 over 64-token pages; the fp16 tier keeps 128)."""
    cfg = with_config(BASE, tile16=128, tile8=128, tile4=128, min_steps=4, stages16=1, stages8=1, stages4=1)
    assert cfg.launch(1, 128) == (64, 4, 1)
    _close(*_run([(40, 100, 70), (3, 64, 1)], 4, 2, 32, 32, (64, 64, 64), splits=2, config=cfg))


def test_served_config_override(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert served_config(128, 4, '{"tile8": 128, "qk_int8": true}') == with_config(DEFAULT_CONFIG, tile8=128,
                                                                                   qk_int8=True)
    assert served_config(128, 4) == SERVED_CONFIGS[(128, 4)] != DEFAULT_CONFIG
    assert served_config(96, 5) == DEFAULT_CONFIG  # a shape the sweep did not choose for
    for bad in ("[1]", '{"tile8": 100}', '{"nope": 1}', "{"):
        with pytest.raises((TypeError, ValueError)):
            served_config(128, 4, bad)


def test_served_int_page_and_record(monkeypatch):
    """Every tuned config names the int page it was timed at, and the record a benchmark keeps
    says where the served config came from."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert set(SERVED_INT_PAGE) == set(SERVED_CONFIGS)
    assert all(p >= 16 and p & (p - 1) == 0 for p in SERVED_INT_PAGE.values())
    rec = describe_served(128, 4)
    assert rec["source"] == "table" and rec["tuned_int_page"] == served_int_page(128, 4)
    assert TieredDecodeConfig(**rec["config"]) == SERVED_CONFIGS[(128, 4)]
    assert describe_served(128, 4, '{"tile8": 128}')["source"] == "override"
    assert describe_served(96, 5) == {"source": "default", "config": describe_served(96, 5)["config"],
                                      "tuned_int_page": None}
    assert served_int_page(96, 5) is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert describe_served(128, 4)["source"] == "interpreter"


# ---- GPU: real shapes, every tier alone and mixed, both dtypes, the sweep's knobs

@pytest.mark.gpu
@pytest.mark.parametrize("Hq,Hkv,D", [(32, 8, 128), (9, 3, 64)])
@pytest.mark.parametrize("mix", ["fp16", "int8", "int4", "mixed"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_real_shapes_gpu(Hq, Hkv, D, mix, dtype):
    base = [3000, 9000, 50, 4100]
    lens = {"fp16": [(n, 0, 0) for n in base], "int8": [(0, n, 0) for n in base],
            "int4": [(0, 0, n) for n in base],
            "mixed": [(64, 2 * n // 3, n - 2 * n // 3) for n in base]}[mix]
    tiers = {"fp16": (0,), "int8": (1,), "int4": (2,), "mixed": (0, 1, 2)}[mix]
    for splits in (None, 7):
        _close(*_run(lens, Hq, Hkv, D, D, (1, 256, 256), dtype=dtype, splits=splits, tiers=tiers), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", [dict(qk_int8=True), dict(fast_cvt=False), dict(fused_merge=False),
                                   dict(tile8=128, tile4=128, stages8=3), dict(tile8=512, tile4=512, warps8=4),
                                   dict(tile16=128, warps16=8, stages16=2), dict(G=32),
                                   dict(dot_cvt=True), dict(dot_cvt=True, sub_cvt=True),
                                   dict(dot_cvt=True, sub_cvt=True, tile8=128, tile4=128),
                                   dict(row_splits=False), dict(merge_prefetch=True),
                                   dict(one_launch=True), dict(one_launch=True, dot_cvt=True, sub_cvt=True, stages4=5),
                                   dict(one_launch=True, fused_merge=False)])
def test_knobs_gpu(knobs):
    knobs = dict(knobs)
    G = knobs.pop("G", 128)
    cfg = with_config(DEFAULT_CONFIG, **knobs)
    lens = [(64, 6000, 700), (300, 0, 4000), (0, 0, 0), (1, 1, 1)]
    _close(*_run(lens, 32, 8, 128, G, (1, 512, 512), splits=9, config=cfg))


@pytest.mark.gpu
def test_fast_conversion_is_exact_gpu():
    """PRMT / LOP3 conversions equal the portable ones on every byte value."""
    import triton
    import triton.language as tl

    from sgl_kvxfer.kernels._tiles import _cvt_nibbles, _cvt_u8

    @triton.jit
    def conv(x_ptr, y_ptr, N: tl.constexpr, FAST: tl.constexpr):
        o = tl.arange(0, N)
        x = tl.load(x_ptr + o)
        lo, hi = _cvt_nibbles(x, FAST)
        tl.store(y_ptr + o, _cvt_u8(x, FAST))
        tl.store(y_ptr + N + o, lo)
        tl.store(y_ptr + 2 * N + o, hi)

    x = torch.arange(256, dtype=torch.uint8, device="cuda").repeat(4)
    ys = []
    for fast in (False, True):
        y = torch.empty(3 * x.numel(), dtype=torch.float16, device="cuda")
        conv[(1,)](x, y, N=x.numel(), FAST=fast)
        ys.append(y)
    assert torch.equal(ys[0], ys[1])
    xf = x.float()
    assert torch.equal(ys[0][:1024].float(), xf)
    assert torch.equal(ys[0][1024:2048].float(), (x & 15).float())
    assert torch.equal(ys[0][2048:].float(), (x >> 4).float())


@pytest.mark.gpu
@pytest.mark.parametrize("sub", [False, True])
def test_one_result_conversions_are_exact_gpu(sub):
    """The one-result PRMT / LOP3 conversions equal the portable ones on every byte value:
    c, lo, 16 * hi, each times 2^-24 with sub (fp16 subnormals)."""
    import triton
    import triton.language as tl

    from sgl_kvxfer.kernels._tiles import _cvt_hi16_one, _cvt_lo_one, _cvt_u8_one

    @triton.jit
    def conv(x_ptr, y_ptr, N: tl.constexpr, FAST: tl.constexpr, SUB: tl.constexpr):
        o = tl.arange(0, N)
        x = tl.load(x_ptr + o)
        tl.store(y_ptr + o, _cvt_u8_one(x, FAST, SUB))
        tl.store(y_ptr + N + o, _cvt_lo_one(x, FAST, SUB))
        tl.store(y_ptr + 2 * N + o, _cvt_hi16_one(x, FAST, SUB))

    x = torch.arange(256, dtype=torch.uint8, device="cuda").repeat(4)
    ys = []
    for fast in (False, True):
        y = torch.empty(3 * x.numel(), dtype=torch.float16, device="cuda")
        conv[(1,)](x, y, N=x.numel(), FAST=fast, SUB=sub)
        ys.append(y)
    assert torch.equal(ys[0].view(torch.int16), ys[1].view(torch.int16))
    u = 2.0 ** -24 if sub else 1.0
    n = x.numel()
    assert torch.equal(ys[0][:n].float(), x.float() * u)
    assert torch.equal(ys[0][n:2 * n].float(), (x & 15).float() * u)
    assert torch.equal(ys[0][2 * n:].float(), (x & 0xF0).float() * u)


@pytest.mark.gpu
def test_cuda_graph_replay_gpu():
    """Captured once, replayed over new K/V contents: the counters stay consistent."""
    layer, tables = build_random_paged_cache([(64, 3000, 900), (10, 20, 3000)], 8, 128, 128, (1, 256, 256),
                                             torch.float16, "cuda", seed=3)
    q = torch.randn(2, 32, 128, device="cuda", dtype=torch.float16)
    plan = _plan(11, 2, 8)
    out = torch.empty_like(q)
    tiered_pool_decode(q, layer, tables, out=out, plan=plan)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        tiered_pool_decode(q, layer, tables, out=out, plan=plan)
    for _ in range(3):
        q.normal_()
        g.replay()
        torch.cuda.synchronize()
        _close(out.float(), tiered_pool_decode_reference(q, layer, tables).float())
    assert bool((plan.counters == 0).all())
