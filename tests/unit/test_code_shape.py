"""The code's shape, as STYLE.md asks it: short functions, classes by role, no import circles,
one module per name, and a cache that knows no model."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("radixrt", "radixrt_kernels")
MAX_FUNCTION_LINES = 60
MAX_PUBLIC_METHODS = 15


def modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports, at module level or inside functions."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join(pkg + ([node.module] if node.module else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                out.add(full if full in known else base)
    return out & set(known)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles() -> None:
    known = modules()
    graph = {name: imported(name, path, known) - {name} for name, path in known.items()}
    assert cycles(graph) == []


def test_the_cache_imports_no_model() -> None:
    known = modules()
    for name, path in known.items():
        if name.startswith("radixrt.cache"):
            bad = {m for m in imported(name, path, known) if m.startswith("radixrt.model")}
            assert not bad, f"{name} imports {sorted(bad)}"


def is_public_method(node: ast.stmt) -> bool:
    """A def whose name has no leading underscore and that is not a property."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
        return False
    return not any(
        (isinstance(d, ast.Name) and d.id == "property") or isinstance(d, ast.Attribute)
        for d in node.decorator_list
    )


def test_short_functions_and_small_classes() -> None:
    long, big = [], []
    for name, path in modules().items():
        if not name.startswith("radixrt."):
            continue  # the kernels' package holds Triton kernels written as one function
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name}")
            elif isinstance(node, ast.ClassDef):
                public = [b.name for b in node.body if is_public_method(b)]
                if len(public) > MAX_PUBLIC_METHODS:
                    big.append(f"{name}.{node.name} ({len(public)})")
    assert long == [] and big == []


def test_one_module_per_name() -> None:
    names = Counter(p.stem for p in modules().values() if p.name != "__init__.py")
    assert [n for n, c in names.items() if c > 1] == []
