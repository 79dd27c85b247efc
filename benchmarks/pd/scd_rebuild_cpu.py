"""The SCD consumer's per-segment rebuild cost on a CPU: per-layer vs stacked (scd/rebuild.py).

    python benchmarks/pd/scd_rebuild_cpu.py [--tokens 1 63 512] [--hidden 512] [--repeats 20]

The layer structure of the Llama-3-8B shape (32 layers, 8 KV heads of 128, 6 Patch layers,
ranks 12 / 20 / 128) with a narrow hidden size, so that small segments measure what a segment
costs whatever its length: the ops launched (on a GPU, kernel launches) and their host time.
Both paths write into a paged bf16 pool. CPU evidence only: on a GPU the launches overlap the
device's work, and the GEMMs of long segments dominate there.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sgl_kvxfer.mem_cache.paged_fp16_pool import PagedFp16KVPool
from sgl_kvxfer.models.arch_config import ModelArchConfig
from sgl_kvxfer.models.presets import PRESETS
from sgl_kvxfer.scd.artifacts import make_random_artifacts
from sgl_kvxfer.scd.codec import KVProjection, ScdDecoder
from sgl_kvxfer.scd.rebuild import StackedRebuild


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def per_layer(dec, projs, m, codes, positions, pool, slots):
    """The per-layer path: each layer through ScdDecoder, each layer's set_kv."""
    dec.rotary.prime(positions, num_positions=int(positions[-1]) + 1)
    for layer in range(m.num_layers):
        if layer in m.reuse_layers:
            k, v = dec.decode_reuse(layer, codes[(layer, "k")], codes[(layer, "v")], positions, torch.bfloat16)
        else:
            k, v = dec.regenerate_patch(layer, codes[(layer, "h")], positions, projs[layer], torch.bfloat16)
        pool.set_kv(layer, slots, k, v)


def stacked(rebuild, m, codes, positions, pool, slots):
    rebuild.rotary.prime(positions, num_positions=int(positions[-1]) + 1)
    for layer_ids, k, v in rebuild.rebuild(codes, positions, torch.bfloat16):
        pool.write_layers(slots, layer_ids, k, v)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 63, 512])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = dict(PRESETS["llama-3-8b"], hidden_size=args.hidden, intermediate_size=2 * args.hidden)
    arch = ModelArchConfig.from_hf_dict(cfg)
    arts = make_random_artifacts(arch, ["c0"], 12, 20, 128, patch_layers=[1, 7, 13, 19, 25, 31], seed=0)
    m = arts.manifest
    g = torch.Generator().manual_seed(0)
    kv = m.num_kv_heads * m.head_dim
    projs = [KVProjection(torch.randn(kv, args.hidden, generator=g).to(torch.bfloat16),
                          torch.randn(kv, args.hidden, generator=g).to(torch.bfloat16)) for _ in range(m.num_layers)]
    dec = ScdDecoder(arts, "c0", "cpu")
    rebuild = StackedRebuild(dec, projs, "cpu")
    pool = PagedFp16KVPool(4096, m.num_layers, m.num_kv_heads, m.head_dim, torch.bfloat16, "cpu", page_size=64)
    rows = []
    for n in args.tokens:
        codes = {(l, k): torch.randn(n, *s, generator=g) for l, k, s in
                 ((l, k, s) for l, k, s in m.code_layout())}
        positions, slots = torch.arange(100, 100 + n), torch.arange(64, 64 + n)
        row = {"tokens": n}
        for name, fn, a in (("per_layer", per_layer, (dec, projs)), ("stacked", stacked, (rebuild,))):
            fn(*a, m, codes, positions, pool, slots)  # warm-up
            with _CountOps() as count:
                fn(*a, m, codes, positions, pool, slots)
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                fn(*a, m, codes, positions, pool, slots)
                times.append(1e3 * (time.perf_counter() - t0))
            row[name] = {"ops": count.n, "ms": round(statistics.median(times), 3)}
        rows.append(row)
        print(json.dumps(row))


if __name__ == "__main__":
    main()
