"""The decode benchmarks' helpers: the engine-layout builder (benchmarks/kernels/engine_layout.py),
the filled-kernel shim and config sweep (attention.py), and the workload pool sizing
(benchmarks/throughput/pool_plan.py)."""
from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "kernels"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "throughput"))

from engine_layout import build_engine_layout, engine_tier_counts, planned_mix  # noqa: E402
from sgl_kvxfer.kernels.tiered_pool_decode import tiered_pool_decode_reference  # noqa: E402


# ---------------------------------------------------------------------------- engine_layout.py
def test_tier_counts_follow_the_plan():
    assert engine_tier_counts(1000, "int8", 8, 128) == (0, 1000, 0)
    assert engine_tier_counts(1000, "fp16", 8, 128) == (1000, 0, 0)
    n16, n8, n4 = engine_tier_counts(32768, "mix_b0.5", 8, 128)
    f16, f8, f4, drop = planned_mix(0.5, 8, 128)
    assert drop == 0 and f8 > 0.9 and f4 > 0  # greedy at b = 0.5 in bytes: int8 and some int4
    assert n16 + n8 + n4 == 32768 and n16 >= 64 and abs(n8 - f8 * (32768 - 64)) <= 1
    with pytest.raises(ValueError, match="unknown tier mix"):
        engine_tier_counts(10, "int2", 8, 128)


def test_engine_layout_is_the_pools_own_view_and_tables():
    """Filled tables over fp16 rows (PAGE 1) and int pages of 64 (G = D) address exactly the tokens
    the allocator gave each request: attention over them equals attention over pool.get_kv."""
    B, Hq, Hkv, D = 2, 4, 2, 32
    counts = (5, 70, 3)
    lay = build_engine_layout(B, counts, Hkv, D, torch.float16, "cpu", copies=2, page_size=64)
    assert lay.max_tokens == sum(counts) and len(lay.tables) == 2
    for t in lay.tables:
        assert t.filled and t.batch_size == B
        for tier, n in enumerate(counts):
            assert t.lens[tier].tolist() == [n] * B
            assert t.fills[tier].sum(1).tolist() == [n] * B
        assert t.num_pages[1].tolist() == [2, 2] and t.fills[1][0, :2].tolist() == [64, 6]  # fresh pages in order
    pages = [set(t.tables[1][:, :2].flatten().tolist()) for t in lay.tables]
    assert not pages[0] & pages[1]  # copies share no page
    layer, t = lay.layer, lay.tables[1]
    assert layer.page_size_of(0) == 1 and layer.page_size_of(1) == layer.page_size_of(2) == 64
    assert layer[1].k_scale.shape[-1] == 1 and layer.group_size == D  # one scale + zero per token-head
    q = torch.randn(B, Hq, D, dtype=torch.float16)
    got = tiered_pool_decode_reference(q, layer, t).float()
    pool = lay.pool
    for b in range(B):
        k, v = pool.get_kv(0, lay.slots[B + b, :sum(counts)])
        k = k.float().repeat_interleave(Hq // Hkv, 1)
        v = v.float().repeat_interleave(Hq // Hkv, 1)
        s = torch.einsum("hd,nhd->hn", q[b].float(), k) / math.sqrt(D)
        want = torch.einsum("hn,nhd->hd", s.softmax(-1), v)
        assert torch.allclose(got[b], want, atol=2e-3), (got[b] - want).abs().max()
    assert lay.kv_bytes(D, 2) == 2 * B * Hkv * (5 * 2 * D + 70 * (D + 4) + 3 * (D // 2 + 4))


# ---------------------------------------------------------------------------- attention.py sweep
@pytest.mark.heavy  # a sweep of about 40 s on 2 cores: CI leaves it out (README, Tests)
def test_sweep_times_every_config_and_measures_with_the_best(tmp_path):
    """The sweep times the served config and each --configs entry on every sweep variant (the mix
    included), the best at the point (lowest geometric mean) measures the table, the best per model
    gives its SERVED_CONFIGS line, and the mix row times each tier's launch alone. On the
    interpreter the served config is INTERPRET_CONFIG (16-token tiles)."""
    import attention

    attention.main(["--device", "cpu", "--points", "smollm2:1:128", "--iters", "1",
                    "--variants", "sdpa", "tiered_int8", "tiered_mix_b0.5", "--sweep-configs",
                    "--configs", json.dumps([{"tile8": 32, "tile16": 16, "int_page": 32}, {"qk_int8": True}]),
                    "--sweep-points", "smollm2:1:128", "--out-dir", str(tmp_path), "--name", "attn"])
    with open(tmp_path / "attn.json") as f:
        data = json.load(f)
    assert not data["partial"]
    rows = data["sweep"]["rows"]
    assert len(rows) == 6 and all("ms" in r for r in rows)  # 3 configs x (tiered_int8, the mix)
    assert {r["variant"] for r in rows} == {"tiered_int8", "tiered_mix_b0.5"}
    assert {json.dumps(r["config"]) for r in rows} == {'"served"', '{"tile8": 32, "tile16": 16, "int_page": 32}',
                                                       '{"qk_int8": true}'}
    assert [r["int_page"] for r in rows if r["config"] != "served" and "int_page" in r["config"]] == [32, 32]
    for r in rows:  # every config but the served one is checked against it on the same cache
        assert (r["config"] == "served") == ("max_abs_diff_vs_served" not in r)
        assert not r.get("wrong"), r
    best, = data["sweep"]["best"]
    assert best["model"] == "smollm2" and "(64, 3)" in best["served_configs_line"] or best["config"] == "served"
    at, = data["sweep"]["best_per_point"]
    assert (at["model"], at["batch"], at["context"]) == ("smollm2", 1, 128)
    # the point's pick is the config with the lowest geometric mean over its two variants
    by_cfg = {}
    for r in rows:
        by_cfg.setdefault(json.dumps(r["config"]), []).append(r["ms"])
    gm = {k: math.exp(sum(map(math.log, v)) / len(v)) for k, v in by_cfg.items()}
    assert json.dumps(at["config"]) == min(gm, key=gm.get) and math.isclose(at["geomean_ms"], min(gm.values()))
    row, = data["results"]
    for v in ("tiered_int8", "tiered_mix_b0.5"):
        assert row[v]["config"] == at["config"] and row[v]["config_source"] == "point"
        assert row[v]["max_abs_diff_vs_reference"] < 3e-2 and "speed_vs_sdpa" in row[v]
    parts = row["tiered_mix_b0.5"]["parts"]  # every tier of the mix alone
    assert sorted(parts) == [f"tier{t}" for t in row["tiered_mix_b0.5"]["tiers"]] and len(parts) > 1
    assert all(p["ms"] > 0 for p in parts.values()) and "parts" not in row["tiered_int8"]
    assert os.path.exists(tmp_path / "attn.png")


def test_a_config_whose_output_departs_is_wrong():
    import attention

    ok = attention.agrees_with_served
    assert ok({}) and ok({"max_abs_diff_vs_served": 0.001, "max_abs_served": 0.5})
    assert not ok({"max_abs_diff_vs_served": 0.2, "max_abs_served": 0.5})
    assert not ok({"max_abs_diff_vs_served": float("nan"), "max_abs_served": 0.5})
    assert not ok({"max_abs_diff_vs_served": float("inf"), "max_abs_served": 0.5})


# ---------------------------------------------------------------------------- pool_plan.py
@pytest.fixture(scope="module")
def llama_arch():
    from sgl_kvxfer.models.arch_config import ModelArchConfig
    from sgl_kvxfer.models.presets import PRESETS

    return ModelArchConfig.from_hf_dict(PRESETS["llama-3-8b"])


@pytest.mark.parametrize("budget", [0.5, 0.25])
def test_tiered_pool_plan_holds_the_workload_and_is_small(llama_arch, budget):
    from pool_plan import plan_pool

    from sgl_kvxfer.config import EngineConfig
    from sgl_kvxfer.mem_cache import tier_store_plan

    p = plan_pool(llama_arch, torch.bfloat16, 16384, 8, budget, 40)
    assert 0 < p["kv_tier_staging"] < 1
    cfg = EngineConfig(kv_tier_budget=budget, kv_int4="on", kv_tier_staging=p["kv_tier_staging"])
    stores = tier_store_plan(cfg, llama_arch, p["pool_tokens"], torch.bfloat16, True)  # what the engine builds
    need = p["store_needs"]
    assert stores.n16 >= need["n16"] >= 16384 + 40 and stores.n8 >= need["n8"] and stores.n4 >= need["n4"]
    for staging in (p["kv_tier_staging"], 0.05, 0.25, 0.5):  # 1% smaller holds it at no staging share
        smaller = tier_store_plan(EngineConfig(kv_tier_budget=budget, kv_int4="on", kv_tier_staging=staging),
                                  llama_arch, int(p["pool_tokens"] * 0.99), torch.bfloat16, True)
        assert (smaller.n16 < need["n16"] or smaller.n8 < need["n8"] or smaller.n4 < need["n4"])  # (near) minimal
    full = plan_pool(llama_arch, torch.bfloat16, 16384, 8, 1.0, 40)
    assert full["pool_tokens"] >= 8 * (16384 + 40) and p["kv_pool_bytes"] < full["kv_pool_bytes"]


def test_fits_records_bytes_needed(llama_arch):
    from pool_plan import fits, plan_pool, weight_bytes_read, weight_bytes_resident

    w = weight_bytes_resident(llama_arch, torch.bfloat16)
    assert w - weight_bytes_read(llama_arch, torch.bfloat16) == 128256 * 4096 * 2  # the input embedding
    p = {**plan_pool(llama_arch, torch.bfloat16, 32768, 32, 1.0, 40), "weight_bytes": w}
    ok, need, free = fits("cuda", p, 6 << 30, free=80 << 30)
    assert not ok and need == w + p["kv_pool_bytes"] + (6 << 30) and free == 80 << 30
    q = {**plan_pool(llama_arch, torch.bfloat16, 32768, 32, 0.25, 40), "weight_bytes": w}
    assert fits("cuda", q, 6 << 30, free=80 << 30)[0]  # a quarter budget fits where fp16 does not


def test_staging_share_is_sized_to_the_fp16_need(llama_arch):
    """At batch 32 the default staging share (0.25) would make the fp16 store 4x its need and the
    pool too large for an 80 GB card at b = 0.5; the plan's own share fits it."""
    from pool_plan import fits, plan_pool, weight_bytes_resident

    from sgl_kvxfer.config import EngineConfig
    from sgl_kvxfer.mem_cache import tier_store_plan

    w = weight_bytes_resident(llama_arch, torch.bfloat16)
    p = plan_pool(llama_arch, torch.bfloat16, 16384, 32, 0.5, 272, page_size=256)
    assert p["kv_tier_staging"] < 0.25
    assert p["stores"]["n16"] - p["store_needs"]["n16"] < 0.01 * p["store_needs"]["n16"]
    assert fits("cuda", {**p, "weight_bytes": w}, 6 << 30, free=78 << 30)[0]
    default = tier_store_plan(EngineConfig(kv_tier_budget=0.5, kv_int4="on", kv_tier_page_size=256), llama_arch,
                              p["pool_tokens"], torch.bfloat16, True)
    need = p["store_needs"]
    assert default.n8 < need["n8"] or default.n4 < need["n4"]  # at the default share this pool falls short


# ---------------------------------------------------------------------------- ncu_decode.py
def test_ncu_raw_csv_summary():
    """ncu's --csv --page raw output (header row, units row, one row per kernel) -> the figures the
    report quotes, with the largest stall ratio as the top stall."""
    from ncu_decode import parse_raw_csv, summarize

    text = "\n".join([
        "==PROF== Connected to process 1",
        '"ID","Kernel Name","gpu__time_duration.sum","gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",'
        '"sm__warps_active.avg.pct_of_peak_sustained_active","launch__registers_per_thread",'
        '"smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",'
        '"smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio"',
        '"","","nsecond","%","%","register/thread","ratio","ratio"',
        '"0","_int_tier_kernel","200,000","71.5","18.2","168","3.1","5.4"',
        '"1","_int_tier_kernel","150000","64.0","22.0","128","1.0","0.5"',
    ])
    rows = parse_raw_csv(text)
    assert len(rows) == 2
    a, b = summarize(rows[0]), summarize(rows[1])
    assert a["duration_us"] == 200.0 and a["dram_throughput_pct"] == 71.5 and a["achieved_occupancy_pct"] == 18.2
    assert a["registers_per_thread"] == 168 and a["top_stalls"][0] == {"reason": "mio_throttle", "warps_per_issue": 5.4}
    assert b["top_stalls"][0]["reason"] == "long_scoreboard"
    assert parse_raw_csv("==ERROR== ERR_NVGPUCTRPERM") == []


def test_ncu_commands_split_sdpa_from_the_tiered_kernels():
    """The tiered kernels are picked by name after their compile launches; SDPA runs in its own ncu
    command, every kernel inside the NVTX range its target pushes, with the forced backend."""
    import argparse

    from ncu_decode import PROFILE_RANGE, ncu_command

    args = argparse.Namespace(point="llama3-8b:1:32768", config='{"warps16": 4}', sdpa_backend="CUDNN_ATTENTION")
    tiered = ncu_command("ncu", args, ["fp16", "int8"])
    assert "regex:_fp16_tier_kernel|_int_tier_kernel" in tiered and "--nvtx" not in tiered
    assert tiered[tiered.index("--launch-skip") + 1] == "2" and tiered[tiered.index("--launch-count") + 1] == "2"
    assert tiered[-2:] == ["--config", '{"warps16": 4}']
    sdpa = ncu_command("ncu", args, ["sdpa"])
    assert sdpa[sdpa.index("--nvtx-include") + 1] == f"{PROFILE_RANGE}/" and "--kernel-name" not in sdpa
    assert sdpa[-2:] == ["--sdpa-backend", "CUDNN_ATTENTION"] and "--config" not in sdpa
    with pytest.raises(ValueError):
        ncu_command("ncu", args, ["fp16", "sdpa"])


def test_decode_step_needs_a_window_longer_than_the_noise():
    """e2e_decode's step is (min T(n2) - min T(n1)) / (n2 - n1): pairs whose T(n2) <= T(n1) (host
    noise larger than the window) are retried, and a window that never resolves is an error, never
    a negative step."""
    from e2e_decode import EXTRA_PAIRS_FOR_NOISE, time_decode_step

    noisy = iter([0.5, 0.4, 0.3, 0.35])  # the first pair inverted by noise, the second resolves
    t1, t2, cached, step = time_decode_step(lambda n: (next(noisy), 7), 1, 3, repeats=1)
    assert t1 == [0.5, 0.3] and t2 == [0.4, 0.35] and cached == [7] * 4
    assert step == pytest.approx((0.35 - 0.3) / 2)
    calls = []
    with pytest.raises(RuntimeError, match="shorter than the timing noise"):
        time_decode_step(lambda n: (calls.append(n) or 1.0, 0), 1, 2, repeats=2)
    assert len(calls) == 2 * (2 + EXTRA_PAIRS_FOR_NOISE)
