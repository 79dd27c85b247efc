"""The serving runtime never imports the offline FusedKV package: no module of sgl_kvxfer outside
sgl_kvxfer/fusedkv/ names sgl_kvxfer.fusedkv in an import."""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = os.path.join(ROOT, "sgl_kvxfer")


def _imports(path: str) -> set[str]:
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_runtime_does_not_import_the_offline_package():
    offenders = []
    for dirpath, dirnames, files in os.walk(PKG, followlinks=False):
        rel = os.path.relpath(dirpath, PKG)
        if rel.split(os.sep)[0] in ("fusedkv", "kernels"):
            dirnames[:] = []
            continue
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                bad = [n for n in _imports(path) if n == "sgl_kvxfer.fusedkv" or n.startswith("sgl_kvxfer.fusedkv.")]
                offenders += [(os.path.relpath(path, ROOT), n) for n in bad]
    assert not offenders, offenders
    assert os.path.isfile(os.path.join(PKG, "models", "fusedkv_llama.py"))  # the runtime model stays there
