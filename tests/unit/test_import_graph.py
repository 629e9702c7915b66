"""No import cycles inside `sobrio`: dependencies point one way, so any module can be read, tested and moved
with what it imports, and a late (function-level) import is never a way to hide a loop.

The graph holds every `import` and `from ... import` statement of every module, at any depth (inside
functions too), resolved to the `sobrio` module it names. The implicit import of a module's parent
packages is not an edge: `sobrio/__init__.py` re-exports the offline API, so every module would otherwise
sit in one loop with it, and no statement of the module chose that.
"""

import ast
from pathlib import Path

import sobrio

ROOT = Path(sobrio.__file__).parent


def module_names() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, for its __init__.py)."""
    names = {}
    for path in ROOT.rglob("*.py"):
        parts = ("sobrio", *path.relative_to(ROOT).with_suffix("").parts)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _innermost(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of a dotted name that is a module (`sobrio.x.func` -> `sobrio.x`)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _base(module: str, node: ast.ImportFrom, modules: dict[str, Path]) -> str:
    """The absolute module a `from` statement imports from, resolving relative levels."""
    if not node.level:
        return node.module or ""
    package = module if modules[module].name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def imports_of(module: str, modules: dict[str, Path]) -> set[str]:
    """The `sobrio` modules one module names in its import statements, wherever they stand."""
    targets = set()
    for node in ast.walk(ast.parse(modules[module].read_text(), str(modules[module]))):
        if isinstance(node, ast.Import):
            targets |= {_innermost(alias.name, modules) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, node, modules)
            targets |= {_innermost(f"{base}.{alias.name}", modules) for alias in node.names}
    return {t for t in targets if t and t != module}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import loop as [a, b, ..., a], or None (depth-first search, colouring modules on the path)."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" after

    def visit(node: str, path: list[str]) -> list[str] | None:  # path: the modules from the start to node
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt, path + [nxt])):
                return cycle
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    return {m: imports_of(m, modules) for m in modules}


def test_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_graph_sees_function_level_imports():
    graph = import_graph()
    assert "sobrio.engine_args" in graph["sobrio.cli"]
    assert "sobrio.bench.cli" in graph["sobrio.cli"]  # imported inside build_parser


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
