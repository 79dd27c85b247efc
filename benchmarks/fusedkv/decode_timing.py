"""Shared by the FusedKV serving benchmarks (serve_bench.py, capacity.py): model dirs of a preset
in each KV layout, warm decode timing with its spread, and the bytes a decode step must read.

TPOT of `batch` radix-cached prompts through Engine.generate (benchmarks/throughput/e2e_decode.py's
method): one untimed generate(n1) and generate(n2) first (JIT, autotune, CUDA-graph capture, the
first decode of this batch size), then `repeats` adjacent pairs, each pair giving one step time

    step_i = (T_i(n2) - T_i(n1)) / (n2 - n1)        (both calls pay the same one-token re-prefill)

reported as the median with min / max / IQR. A pair whose difference is not positive says the
timer noise exceeds the decode work: the point is marked `unstable`, and with a non-positive median
TPOT is None (never a negative time).

Bytes per decode step: every weight a forward reads (ModelShape.weight_bytes_per_forward) plus the
KV each layer attends, per token of context: a storing layer reads its own K and V; a FusedKV
reconstruction layer reads K and V of both source layers (2x); a Lite one reads one layer's K and
another's V (1x). min_step_s = bytes / copy bandwidth (read + write bytes per second of a
device-to-device copy, measured in the same run); a step faster than that is flagged.
"""
from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import kernel_profile  # noqa: E402
from common.roofline import ModelShape  # noqa: E402

VARIANTS = ("vanilla", "fusedkv", "lite")
SLACK = 3 * 64  # tokens per request beyond context + n2: the recomputed token, page tails
HEADROOM_BYTES = 6 * 2**30  # activations of a prefill chunk, CUDA graphs, allocator slack


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def write_variant(preset: str, variant: str, root: str) -> str:
    """The preset's config.json (+ a fusedkv section: the bottom half stores KV) and a dummy
    tokenizer in root/variant."""
    from sgl_kvxfer.models.presets import PRESETS, write_dummy_tokenizer, write_preset_config

    d = write_preset_config(preset, os.path.join(root, variant))
    if variant != "vanilla":
        path = os.path.join(d, "config.json")
        with open(path) as f:
            cfg = json.load(f)
        cfg["fusedkv"] = {"variant": variant}
        with open(path, "w") as f:
            json.dump(cfg, f, indent=2)
    return write_dummy_tokenizer(d, PRESETS[preset]["vocab_size"])


def elem_bytes(dtype: str) -> int:
    return torch.finfo(getattr(torch, dtype)).bits // 8


def layer_kv_bytes(arch, dtype: str) -> int:
    """K + V bytes of one layer for one token."""
    return 2 * arch.num_key_value_heads * arch.head_dim * elem_bytes(dtype)


def kv_stored_bytes_per_token(arch, dtype: str, variant: str) -> int:
    L = arch.num_hidden_layers
    return (L if variant == "vanilla" else L // 2) * layer_kv_bytes(arch, dtype)


def kv_read_bytes_per_token(arch, dtype: str, variant: str) -> int:
    """KV bytes one decode step reads per token of context (see the module docstring)."""
    L, n = arch.num_hidden_layers, arch.num_hidden_layers // 2
    layers = {"vanilla": L, "fusedkv": n + 2 * (L - n), "lite": L}[variant]
    return layers * layer_kv_bytes(arch, dtype)


def weight_bytes(arch, dtype: str, variant: str) -> tuple[int, int]:
    """(bytes a forward reads, bytes resident): the top half of a FusedKV / Lite model has no
    k_proj / v_proj."""
    s = ModelShape.from_arch(arch)
    e = elem_bytes(dtype)
    read = s.weight_bytes_per_forward(e)
    if variant != "vanilla":
        read -= (s.layers - s.layers // 2) * 2 * s.hidden * s.kv_heads * s.head_dim * e
    resident = read + (0 if s.tied_embeddings else s.vocab * s.hidden * e)
    return read, resident


def timed(engine, prompts, n: int) -> float:
    params = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    sync()
    t = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    sync()
    assert all(o["meta_info"]["completion_tokens"] == n for o in outs)
    return time.perf_counter() - t


def spread(xs: list[float]) -> dict:
    q = statistics.quantiles(xs, n=4) if len(xs) >= 2 else [xs[0]] * 3
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "q1": q[0], "q3": q[2], "n": len(xs)}


def random_prompts(batch: int, context: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(context)] for _ in range(batch)]


def measure_tpot(engine, prompts, n1: int, n2: int, repeats: int) -> dict:
    """Warm decode step time of `prompts` (already prefilled) with its spread (module docstring)."""
    timed(engine, prompts, n1)
    timed(engine, prompts, n2)
    pairs = []
    for _ in range(repeats):
        pairs.append((timed(engine, prompts, n1), timed(engine, prompts, n2)))
    steps = [(b - a) / (n2 - n1) for a, b in pairs]
    s = spread(steps)
    return {"tpot_s": s["median"] if s["median"] > 0 else None, "step_spread_s": s,
            "unstable": any(x <= 0 for x in steps), "n1_s": [a for a, _ in pairs], "n2_s": [b for _, b in pairs]}


def kernel_breakdown(engine, prompts, n1: int, n2: int, cuda: bool, top: int = 12) -> dict:
    """Device time of one decode step of `prompts` (already prefilled) per kernel and per group:
    common.kernel_profile.kernel_breakdown over generate(n), the same difference as measure_tpot."""
    return kernel_profile.kernel_breakdown(lambda n: timed(engine, prompts, n), n1, n2, cuda, top)


def step_roofline(row: dict, arch, dtype: str, variant: str, batch: int, context: int, n1: int, n2: int,
                  copy_bw: float) -> None:
    """Bytes of one step and the least time they take at the copy bandwidth, into row (in place)."""
    read, _ = weight_bytes(arch, dtype, variant)
    tokens = batch * (context + (n1 + n2) // 2)  # what a timed step attends, on average
    row["step_bytes"] = read + tokens * kv_read_bytes_per_token(arch, dtype, variant)
    row["min_step_s"] = row["step_bytes"] / copy_bw
    tpot = row.get("tpot_s")
    row["faster_than_bytes_allow"] = tpot is not None and tpot < row["min_step_s"]
    row["fraction_of_roofline"] = row["min_step_s"] / tpot if tpot else None


def engine_memory_kwargs(device: str, weights_resident: int, pool_bytes: int) -> dict:
    """A memory fraction that gives the pool exactly what it asks (engine/memory.py caps it at
    max_total_tokens): what others use + weights + pool + 1 GiB, of the device total."""
    if device == "cpu":
        return {}
    free, total = torch.cuda.mem_get_info()
    return {"mem_fraction_static": min(0.97, (total - free + weights_resident + pool_bytes + 2**30) / total)}


def device_free_bytes(device: str) -> int | None:
    return torch.cuda.mem_get_info()[0] if device.startswith("cuda") else None
