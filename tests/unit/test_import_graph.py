"""tessera's import graph, counting imports inside functions: no cycle, and tessera.config a leaf.

The graph is read from the source with ``ast`` (every ``import`` statement anywhere in a module,
``TYPE_CHECKING`` blocks excluded because they never run). ``cli.py`` imports each command's module
inside its handler on purpose (``tessera --help`` stays instant); those edges are the one exception.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "tessera"
LAZY_COMMAND_MODULE = "tessera.cli"


def module_name(path: Path) -> str:
    """The dotted module name of a file under tessera/ (a package is named by its __init__)."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree: ast.AST, here: str, is_package: bool) -> list[tuple[str, bool]]:
    """(imported module, inside a function) for every import that can run."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if _is_type_checking(node):
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, in_function) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".") if is_package else here.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.append((base, in_function))
            found.extend((f"{base}.{alias.name}", in_function) for alias in node.names)
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, False)
    return found


def _with_parents(target: str) -> list[str]:
    """``a.b.c`` and the packages importing it runs first (``a.b``); the root ``tessera`` is left out."""
    parts = target.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts) + 1)]


def import_graph() -> dict[str, set[str]]:
    """Module -> the tessera modules it imports (at module level or inside any function)."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for target, in_function in _imports(tree, name, path.name == "__init__.py"):
            if name == LAZY_COMMAND_MODULE and in_function:
                continue
            # a module's own packages are already being imported when it runs, so they add no edge
            graph[name].update(m for m in _with_parents(target) if m in files and not f"{name}.".startswith(f"{m}."))
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as a list of modules (first == last), or [] when there is none."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        stack.pop()
        return []

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return []


def test_the_import_graph_has_no_cycle_even_counting_imports_inside_functions():
    cycle = find_cycle(import_graph())
    assert not cycle, " -> ".join(cycle)


def test_tessera_config_imports_nothing_of_tessera_but_errors():
    graph = import_graph()
    outside = {
        (name, target)
        for name, targets in graph.items()
        if name.startswith("tessera.config")
        for target in targets
        if not target.startswith("tessera.config") and target != "tessera.errors"
    }
    assert not outside, sorted(outside)


def test_a_cycle_is_found_when_one_exists():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []
