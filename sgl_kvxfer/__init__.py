"""sgl_kvxfer: an LLM serving runtime in SGLang's architecture with a compressible KV cache."""

__version__ = "0.1.0"


def __getattr__(name):  # lazy: importing the package must not load torch-heavy modules
    if name == "Engine":
        from sgl_kvxfer.entrypoints.engine import Engine

        return Engine
    raise AttributeError(name)
