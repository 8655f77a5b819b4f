"""The package's shape, read from the sources: no import cycle anywhere (an import inside a
function, or under TYPE_CHECKING, counts as an edge), the HTTP front reaches the rest of the
server through its interface module alone, the cache imports no model, functions stay short and
classes small (STYLE.md), and no two modules share a name."""

from __future__ import annotations

import ast
import pathlib
from collections import Counter

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("radixrt", "radixrt_kernels")
MAX_FUNCTION_LINES = 60
MAX_PUBLIC_METHODS = 15


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: pathlib.Path, module: str) -> set[str]:
    """Every module name ``path`` imports (and ``from X import name``: ``X.name`` too)."""
    names: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports, with the packages whose ``__init__`` an
    import runs (importing a.b.c runs a and a.b first)."""
    paths = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph = {}
    for module, path in paths.items():
        edges = set()
        for name in imported(path, module):
            parts = name.split(".")
            for i in range(1, len(parts) + 1):
                target = ".".join(parts[:i])
                if target in paths and not module.startswith(target + ".") and target != module:
                    edges.add(target)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycles_are_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_http_front_sees_the_server_through_its_interface():
    allowed = {"radixrt.server", "radixrt.server.front_api", "radixrt.server.metrics"}
    for module, edges in import_graph().items():
        if module.startswith("radixrt.server.http"):
            outside = {
                t
                for t in edges
                if t.startswith("radixrt.server") and not t.startswith("radixrt.server.http")
            }
            assert outside <= allowed, f"{module} imports {sorted(outside - allowed)}"


def test_the_cache_imports_no_model():
    for module, edges in import_graph().items():
        if module.startswith("radixrt.cache"):
            bad = {t for t in edges if t.startswith(("radixrt.model", "radixrt_kernels"))}
            assert not bad, f"{module} imports {sorted(bad)}"


def is_public_method(node: ast.stmt) -> bool:
    """A def whose name has no leading underscore and that is not a property."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
        return False
    return not any(
        (isinstance(d, ast.Name) and d.id == "property") or isinstance(d, ast.Attribute)
        for d in node.decorator_list
    )


def test_short_functions_and_small_classes() -> None:
    """In radixrt/ (radixrt_kernels/ holds Triton kernels written as one function each)."""
    long, big = [], []
    for path in (ROOT / "radixrt").rglob("*.py"):
        name = module_name(path)
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
    paths = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    names = Counter(p.stem for p in paths if p.name != "__init__.py")
    assert [n for n, c in names.items() if c > 1] == []
