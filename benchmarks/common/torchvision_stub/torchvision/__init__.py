"""Import-only stand-in for torchvision, put on the path of `sglang.bench_serving` runs alone.

bench_serving (SGLang 0.5.23) imports `sglang.srt.configs`, whose multimodal configs import
`torchvision.transforms` at module load; text datasets (random-ids, the ones our tests and
benchmarks use) never call into it. PyPI's torchvision wheels are CUDA builds that fail to load
beside the CPU torch this project installs ("operator torchvision::nms does not exist"), so
instead of a second virtualenv with a CUDA torch, this module answers every `torchvision.*`
import with placeholders that raise on first use. An image dataset would fail loudly, not
silently. It is never on the path of our own server, tests or the DSL.
"""
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+stub"
__path__ = []  # a package: submodule imports come to the finder below


class _Unavailable:
    """Any attribute of a stubbed module: usable in annotations and class bases, raises when called."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        return _Unavailable(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchvision is not installed (import-only stand-in for bench_serving)")

    def __mro_entries__(self, bases):
        return (object,)


class _StubModule(types.ModuleType):
    __path__ = []

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self.__name__}.{attr}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _StubFinder())


def __getattr__(attr):
    if attr.startswith("__"):
        raise AttributeError(attr)
    return _Unavailable(f"torchvision.{attr}")
