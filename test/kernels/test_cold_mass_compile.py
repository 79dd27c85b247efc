"""pool_token_mass's kernel compiles for sm_90 (Hopper) with the installed Triton, on CPU: no GPU
needed, only Triton's CUDA backend and its bundled ptxas. Every shape the kernel tests launch
and the Llama-3-8B shape, in fp32, fp16 and bf16, int64 and int32 lengths, at the launcher's
constexprs and warps. The interpreter tests cannot catch a failing GPU lowering (Triton 3.6's
layout pass crashes on 1-D per-token vectors used in two 2-D layouts at TILE 32); this does.

The compiles run in one subprocess (this file as a script) with TRITON_INTERPRET unset: under the
interpreter, @triton.jit gives functions the compiler cannot take."""
import json
import os
import shutil
import subprocess
import sys

import pytest

# (Hq, Hkv, D, group, page, tile): test_cold_mass.py's parametrizations, its max-accumulation
# test (launcher's default tile), and the real shape (Llama-3-8B heads, page 256, default tile)
SHAPES = [(8, 2, 32, 32, 8, 32), (4, 1, 64, 16, 8, 32), (2, 1, 32, 32, 8, 16), (32, 8, 128, 32, 256, 16)]
DTYPES = ["fp32", "fp16", "bf16"]
LENS = ["i64", "i32"]
POINTERS = {"rows_ptr": "i64", "k8_ptr": "u8", "h8_ptr": "fp16", "k4_ptr": "u8", "h4_ptr": "fp16",
            "m_ptr": "fp32", "l_ptr": "fp32", "s_ptr": "fp32"}


def _key(shape, dtype, lens_type) -> str:
    return "hq{}-hkv{}-d{}-g{}-p{}-t{}".format(*shape) + f"-{dtype}-{lens_type}"


def _compile_all() -> dict:
    """{key: "ok" or the error's last lines} for every (shape, dtype, lens type), compiled for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sgl_kvxfer.kernels.cold_mass import NUM_WARPS, _logits_kernel, launch_constants

    results = {}
    for shape in SHAPES:
        for dtype in DTYPES:
            for lens_type in LENS:
                consts = launch_constants(*shape)
                types = {**POINTERS, "q_ptr": dtype, "k16_ptr": dtype, "lens_ptr": lens_type}
                sig = {name: "constexpr" if name in consts else "*" + types[name] if name in types
                       else "fp32" if name == "qk_scale" else "i32" for name in _logits_kernel.arg_names}
                try:
                    kernel = triton.compile(ASTSource(_logits_kernel, sig, constexprs=consts),
                                            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=NUM_WARPS))
                    ok = bool(kernel.asm["cubin"]) and ".target sm_90" in kernel.asm["ptx"]
                    results[_key(shape, dtype, lens_type)] = "ok" if ok else "no sm_90 cubin"
                except Exception as exc:  # noqa: BLE001 - reported per case by the test
                    results[_key(shape, dtype, lens_type)] = " | ".join(str(exc).strip().splitlines()[-3:])[:800]
    return results


@pytest.fixture(scope="module")
def compiled():
    try:
        import triton
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"Triton's compiler API unavailable: {exc}")
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not (os.access(ptxas, os.X_OK) or shutil.which("ptxas")):
        pytest.skip("Triton's CUDA backend has no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("lens_type", LENS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "hq{}-hkv{}-d{}-g{}-p{}-t{}".format(*s))
def test_compiles_for_sm90(compiled, shape, dtype, lens_type):
    assert compiled[_key(shape, dtype, lens_type)] == "ok", compiled[_key(shape, dtype, lens_type)]


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    print(json.dumps(_compile_all()))
