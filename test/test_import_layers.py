"""The import rules of the package layers, read from the source with `ast` (no module runs).

    kernels            <- layers <- models <- engine <- scheduler <- server / entrypoints
    (own torch refs)      (RMSNorm, RoPE, fused ops, linear helpers, attention backends)

- layers/ imports nothing from models/, engine/, scheduler/, server/;
  models/ nothing from engine/, scheduler/, server/; kernels/ nothing from any of them;
- no two packages of sgl_kvxfer import each other, directly or round a longer loop;
- the runtime (every module `python -m sgl_kvxfer.launch_server` can reach, lazy imports and
  the registries' "module:Class" strings included) imports no offline tooling. The rule is on
  module names, so it holds for offline packages that do not exist yet.

An import inside a function counts like one at the top of a module: it is still an arrow.
Only imports under `if TYPE_CHECKING:` are skipped. Run as a script to print the package graph:
`python test/test_import_layers.py`.
"""
from __future__ import annotations

import ast
import re
import sys
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNTIME_ENTRY = "sgl_kvxfer.launch_server"
OFFLINE = ("sgl_kvxfer.tasks", "sgl_kvxfer.scd.calib", "sgl_kvxfer.fusedkv", "benchmarks", "scripts")
LOWER_THAN = {  # package -> packages it must not import
    "kernels": {"layers", "models", "engine", "scheduler", "server", "mem_cache", "disagg", "entrypoints"},
    "layers": {"models", "engine", "scheduler", "server"},
    "models": {"engine", "scheduler", "server"},
}
# lazy registries: "sgl_kvxfer.pkg.mod:Class", or "mod:Class" under the registry's own package
_REGISTRY_STRING = re.compile(r"^((?:sgl_kvxfer\.)?[\w.]+):[A-Z]\w*$")


@lru_cache(maxsize=None)
def module_files() -> dict[str, Path]:
    """Every module of the installed package: sgl_kvxfer/ plus kernels/ as sgl_kvxfer.kernels."""
    out = {}
    for prefix, base in (("sgl_kvxfer", ROOT / "sgl_kvxfer"), ("sgl_kvxfer.kernels", ROOT / "kernels")):
        for path in base.rglob("*.py"):
            rel = path.relative_to(base).with_suffix("").parts
            if prefix == "sgl_kvxfer" and rel[0] == "kernels":  # the git-ignored link to kernels/
                continue
            parts = rel[:-1] if rel[-1] == "__init__" else rel
            out[".".join((prefix, *parts))] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


@lru_cache(maxsize=None)
def raw_imports(module: str) -> frozenset[str]:
    """Dotted names `module` imports (for `from a import b`: both a and a.b)."""
    path = module_files()[module]
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_nodes(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            m = _REGISTRY_STRING.match(node.value)
            if m and m.group(1).startswith("sgl_kvxfer."):
                names.add(m.group(1))
            elif m and f"{package}.{m.group(1)}" in module_files():
                names.add(f"{package}.{m.group(1)}")
    return frozenset(n for n in names if n)


def resolve(name: str) -> str | None:
    """The module a dotted import name lands in (the longest existing prefix), or None."""
    files = module_files()
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        candidate = ".".join(parts[:i])
        if candidate in files:
            return candidate
    return None


def package_of(module: str) -> str | None:
    """sgl_kvxfer.engine.model_runner -> engine; sgl_kvxfer.config -> config; the root -> None."""
    parts = module.split(".")
    return parts[1] if parts[0] == "sgl_kvxfer" and len(parts) > 1 else None


def module_deps(module: str) -> set[str]:
    deps = set()
    for name in raw_imports(module):
        target = resolve(name)
        if target is not None and target != module and target.startswith("sgl_kvxfer"):
            deps.add(target)
    return deps


def package_graph() -> dict[str, dict[str, list[str]]]:
    """package -> {imported package: ["importer -> imported module", ...]}."""
    graph: dict[str, dict[str, list[str]]] = {}
    for module in module_files():
        src = package_of(module)
        if src is None:
            continue
        graph.setdefault(src, {})
        for dep in module_deps(module):
            dst = package_of(dep)
            if dst is not None and dst != src:
                graph[src].setdefault(dst, []).append(f"{module} -> {dep}")
    return graph


def strongly_connected(graph: dict[str, dict]) -> list[list[str]]:
    """Tarjan's algorithm: the components of more than one package (each holds a cycle)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def mutual_pairs(graph: dict[str, dict]) -> list[tuple[str, str]]:
    return sorted((a, b) for a in graph for b in graph[a] if a < b and a in graph.get(b, {}))


def runtime_modules(entry: str = RUNTIME_ENTRY) -> set[str]:
    """Every module reachable from `entry`, with the parent packages each import runs."""
    seen, todo = set(), [entry]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        for dep in module_deps(module):
            parts = dep.split(".")
            todo.extend(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return {m for m in seen if m in module_files()}


def _is_offline(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in OFFLINE)


# ---------------------------------------------------------------------------- tests
def test_lower_packages_import_nothing_above_them():
    graph = package_graph()
    bad = [edge for pkg, banned in LOWER_THAN.items() for dst in sorted(banned & set(graph.get(pkg, {})))
           for edge in graph[pkg][dst]]
    assert not bad, "imports pointing up:\n" + "\n".join(bad)


def test_no_package_level_import_cycles():
    graph = package_graph()
    cycles = strongly_connected(graph)
    detail = [e for a, b in mutual_pairs(graph) for e in graph[a][b] + graph[b][a]]
    assert not cycles, f"package cycles {cycles}:\n" + "\n".join(detail)


def test_runtime_imports_no_offline_tooling():
    modules = runtime_modules()
    assert "sgl_kvxfer.scheduler.scheduler" in modules and "sgl_kvxfer.server.app" in modules  # the walk reaches
    bad = sorted(f"{m} imports {n}" for m in modules for n in raw_imports(m) if _is_offline(n))
    bad += sorted(m for m in modules if _is_offline(m))
    assert not bad, "the runtime reaches offline tooling:\n" + "\n".join(bad)


def test_walker_sees_lazy_relative_and_registry_imports():
    """The rules above are only as good as the walk: it must see the three kinds of arrow."""
    assert "sgl_kvxfer.kernels.tier_codec" in module_deps("sgl_kvxfer.kernels")  # relative
    assert "sgl_kvxfer.mem_cache.fp16_pool" in module_deps("sgl_kvxfer.mem_cache")  # registry string
    assert "sgl_kvxfer.spectrum.policies.greedy" in module_deps("sgl_kvxfer.spectrum.policies")  # relative one
    assert "sgl_kvxfer.engine.model_runner" in module_deps("sgl_kvxfer.scheduler.startup")  # in a function
    assert _is_offline("sgl_kvxfer.scd.calib.fit") and not _is_offline("sgl_kvxfer.scd.codec")


def largest_files(n: int = 10) -> list[tuple[int, str]]:
    """(lines, path) of the n longest Python files the repository tracks."""
    import subprocess

    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    sizes = [(sum(1 for _ in open(ROOT / f, errors="replace")), f) for f in files if (ROOT / f).is_file()]
    return sorted(sizes, reverse=True)[:n]


if __name__ == "__main__":
    g = package_graph()
    for pkg in sorted(g):
        print(f"{pkg:12s} -> {', '.join(sorted(g[pkg])) or '-'}")
    print("cycles (strongly connected packages):", strongly_connected(g) or "none")
    print("mutual pairs:", mutual_pairs(g) or "none")
    if "-v" in sys.argv:
        for a, b in mutual_pairs(g):
            print("\n".join(["  " + e for e in g[a][b] + g[b][a]]))
    rt = runtime_modules()
    print(f"runtime modules reachable from {RUNTIME_ENTRY}: {len(rt)}")
    print("largest files:", *(f"{n:6d} {f}" for n, f in largest_files()), sep="\n")
