"""Offline compile report of the tiered decode kernels (CPU only, no GPU): per kernel, registers,
spill stack, shared memory, and which loads of the decode loop Triton's software pipeliner turns
into cp.async prefetches and which it leaves synchronous.

    python benchmarks/kernels/compile_report.py                       # int8, int4, fp16 at the defaults
    python benchmarks/kernels/compile_report.py --config '{"tile8": 128, "stages8": 5}' --int-page 256
    python benchmarks/kernels/compile_report.py --head-dim 64 --kv-group 3 --json /tmp/report.json

Each kernel is compiled for sm_<arch> (default 90) as the launcher would launch it (the config's
tile / warps / stages; int tiers at --int-page, fp16 rows at page 1; filled tables; fused merge;
divisibility hints as Triton's launcher gives 16-aligned pointers and strides), with the installed
Triton: what the pipeliner does depends on its version, so compare with the GPU machine's (Triton
3.6: `pip download triton==3.6.0`, install it into a folder and put that first on PYTHONPATH).
In the TTGIR of the decode loop (the first scf.for of the kernel): `prefetched` counts the
async copies (cp.async into shared memory, issued stages ahead), `synchronous` the tt.load ops (a
global load the loop waits on each step). Registers and spill stack come from cuobjdump of the
cubin (bundled with Triton); `loop_sass` is the SASS of the loop body (the backward branch's range
with the most HMMA): instructions per warp per step and the conversion / shared-memory / math
opcodes among them.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

TIER_IDS = {"fp16": 0, "int8": 1, "int4": 2}


def _signature(fn, constexprs: dict, int_tier: bool, qt: str):
    """Argument types and divisibility-16 hints of a tier kernel (what the launcher passes)."""
    ptrs = {"q_ptr": qt, "out_ptr": qt, "o_part_ptr": "fp32", "lse_part_ptr": "fp32", "cnt_ptr": "i32",
            "k_ptr": "u8" if int_tier else qt, "v_ptr": "u8" if int_tier else qt, "ks_ptr": "fp16",
            "vs_ptr": "fp16", "bt_ptr": "i32", "fill_ptr": "i32", "len_ptr": "i32", "npg_ptr": "i32"}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in ptrs:
            sig[name] = "*" + ptrs[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name == "qk_scale":
            sig[name] = "fp32"
        else:  # strides (all multiples of 16 at real shapes but lse's head stride), split ids
            sig[name] = "i32"
            if name.startswith("stride_") and name != "stride_lh":
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def _loop_body(ttgir: str) -> str:
    """The text of the first scf.for (the decode loop) of a TTGIR module."""
    lines = ttgir.splitlines()
    start = next(i for i, l in enumerate(lines) if "scf.for" in l)
    indent = len(lines[start]) - len(lines[start].lstrip())
    end = next(i for i in range(start + 1, len(lines))
               if lines[i].strip().startswith("}") and len(lines[i]) - len(lines[i].lstrip()) == indent)
    return "\n".join(lines[start:end + 1])


LOOP_OPS = ("HMMA", "IMMA", "PRMT", "LOP3", "SHF", "HADD2", "I2F", "FFMA", "FMUL", "FADD", "MUFU", "IMAD",
            "LDGSTS", "LDG", "LDS", "LDSM", "STS", "BAR")


def _loop_sass(cubin: bytes) -> dict:
    """Opcode counts of the decode loop's body in SASS (the backward branch range with most HMMA)."""
    import collections

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True).stdout
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)\S*\s*(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2), m.group(3)))
    best = None
    for addr, op, args in ins:
        target = re.search(r"0x([0-9a-f]+)", args) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr:
            body = [x for x in ins if int(target.group(1), 16) <= x[0] <= addr]
            hmma = sum(1 for x in body if x[1] in ("HMMA", "IMMA"))
            if best is None or hmma > best[0]:
                best = (hmma, body)
    if best is None:
        return {}
    ops = collections.Counter(x[1] for x in best[1])
    return {"instructions": len(best[1]), **{k: ops[k] for k in LOOP_OPS if ops[k]}}


def _resources(cubin: bytes) -> dict:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        out = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True).stdout
    regs, stack = re.search(r"REG:(\d+)", out), re.search(r"STACK:(\d+)", out)
    return {"registers": int(regs.group(1)) if regs else None, "spill_stack_bytes": int(stack.group(1)) if stack else None}


def compile_tier(tier: str, config, head_dim: int, kv_group: int, int_page: int, arch: int, qt: str) -> dict:
    """Compile one tier's kernel (config: TieredDecodeConfig) and report (module docstring)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile as triton_compile

    from sgl_kvxfer.kernels._tiered_decode_kernels import _fp16_tier_kernel, _int_tier_kernel
    from sgl_kvxfer.kernels._tiles import next_pow2
    from sgl_kvxfer.kernels.tiered_pool_decode import merge_step

    t = TIER_IDS[tier]
    tile, warps, stages = config.launch(t)
    common = dict(NUM_KV_HEADS=8, KV_GROUP=kv_group, BLOCK_G=max(16, next_pow2(kv_group)), HEAD_DIM=head_dim,
                  FILLED=True, DIRECT=False, FUSED_MERGE=config.fused_merge, FENCE=True,
                  MERGE_H=next_pow2(kv_group), MERGE_S=merge_step(warps), MERGE_PF=config.merge_prefetch, TILE=tile)
    if t == 0:
        fn, page = _fp16_tier_kernel, 1
        consts = dict(PAGE=page, DOT_F32=False, ROW_SPLITS=config.row_splits, **common)
    else:
        fn, page = _int_tier_kernel, int_page
        halves = 1 if t == 1 else 2
        packable = tile * (head_dim // halves) >= 8 * 32 * warps
        consts = dict(TIER=t, GROUP_SIZE=head_dim, PAGE=page, QK_INT8=config.qk_int8 and head_dim // halves >= 32,
                      FAST_CVT=config.fast_cvt and packable, DOT_CVT=config.dot_cvt,
                      SUB_CVT=config.sub_cvt and config.dot_cvt, **common)
    sig, attrs = _signature(fn, consts, t != 0, qt)
    kernel = triton_compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", arch, 32),
                            options=dict(num_warps=warps, num_stages=stages))
    body = _loop_body(kernel.asm["ttgir"])
    return {"tier": tier, "page": page, "tile": tile, "warps": warps, "stages": stages,
            **_resources(kernel.asm["cubin"]), "shared_bytes": kernel.metadata.shared,
            "prefetched": body.count("ttg.async_copy_global_to_local"), "synchronous": len(re.findall(r"\btt\.load\b", body)),
            "loop_sass": _loop_sass(kernel.asm["cubin"])}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiers", nargs="+", default=["int8", "int4", "fp16"], choices=list(TIER_IDS))
    ap.add_argument("--config", type=json.loads, default={}, help="TieredDecodeConfig fields (JSON object)")
    ap.add_argument("--head-dim", type=int, default=128, choices=[32, 64, 128, 256])
    ap.add_argument("--kv-group", type=int, default=4, help="q heads per kv head (1-64)")
    ap.add_argument("--int-page", type=int, default=64, help="int tiers' page (power of two >= 16)")
    ap.add_argument("--arch", type=int, default=90, choices=[80, 89, 90], help="sm_<arch>")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    if not isinstance(args.config, dict):
        ap.error("--config must be a JSON object of TieredDecodeConfig fields")
    if not 1 <= args.kv_group <= 64:
        ap.error("--kv-group must be in [1, 64]")
    if args.int_page < 16 or args.int_page & (args.int_page - 1):
        ap.error("--int-page must be a power of two >= 16")
    os.environ.pop("TRITON_INTERPRET", None)
    import triton

    from sgl_kvxfer.kernels.tiered_pool_decode import DEFAULT_CONFIG, with_config

    try:
        config = with_config(DEFAULT_CONFIG, **args.config)
    except (TypeError, ValueError) as exc:
        ap.error(f"--config: {exc}")
    qt = "fp16" if args.dtype == "float16" else "bf16"
    rows = [compile_tier(t, config, args.head_dim, args.kv_group, args.int_page, args.arch, qt) for t in args.tiers]
    print(f"Triton {triton.__version__}, sm_{args.arch}, head_dim {args.head_dim}, {args.kv_group} q heads per kv head")
    for r in rows:
        print("  ".join(f"{k} {v}" for k, v in r.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"triton": triton.__version__, "arch": args.arch, "config": str(config), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
