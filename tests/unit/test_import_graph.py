"""tessera's import graph, counting imports inside functions: no cycle, tessera.config a leaf, and
docs/ARCHITECTURE.md's import table and module list equal to the code.

The graph is read from the source with ``ast`` (every ``import`` statement anywhere in a module,
``TYPE_CHECKING`` blocks included: a cycle of type-only imports is still a cycle of the design). ``cli.py`` imports each command's module
inside its handler on purpose (``tessera --help`` stays instant); those edges are the one exception.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "tessera"
ARCHITECTURE = PACKAGE.parent / "docs" / "ARCHITECTURE.md"
LAZY_COMMAND_MODULE = "tessera.cli"


def module_name(path: Path) -> str:
    """The dotted module name of a file under tessera/ (a package is named by its __init__)."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST, here: str, is_package: bool) -> list[tuple[str, bool]]:
    """(imported module, inside a function) for every import statement, ``TYPE_CHECKING`` blocks included."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
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


def import_graph(lazy_commands: bool = False) -> dict[str, set[str]]:
    """Module -> the tessera modules it imports (at module level or inside any function; ``cli.py``'s
    per-command imports inside its handlers only with ``lazy_commands``)."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for target, in_function in _imports(tree, name, path.name == "__init__.py"):
            if name == LAZY_COMMAND_MODULE and in_function and not lazy_commands:
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


def unit(module: str) -> str:
    """The room of the architecture a module belongs to: its top-level package (``train``) or module (``layout``)."""
    return module.split(".")[1] if "." in module else module


def package_graph() -> dict[str, set[str]]:
    """Top-level package or module -> the others it imports, counting every import inside functions
    (``cli.py``'s lazy command imports included: the table says what each room reaches)."""
    rooms: dict[str, set[str]] = {}
    for name, targets in import_graph(lazy_commands=True).items():
        if name == "tessera":
            continue
        here = unit(name)
        rooms.setdefault(here, set()).update(unit(t) for t in targets if t != "tessera" and unit(t) != here)
    return rooms


def parse_import_table(text: str) -> dict[str, set[str]]:
    """The table between ``<!-- imports:start -->`` and ``<!-- imports:end -->`` of a page (or a bare table)."""
    block = text.split("<!-- imports:start -->", 1)[-1].split("<!-- imports:end -->", 1)[0]
    table: dict[str, set[str]] = {}
    for line in block.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0].startswith("`"):
            continue
        room = cells[0].strip("`").removesuffix("/").removesuffix(".py")
        table[room] = {t.strip().strip("`") for t in cells[1].split(",") if t.strip() not in ("", "nothing")}
    return table


def render_import_table() -> str:
    """The table as docs/ARCHITECTURE.md must hold it (print it to update the page)."""
    graph = package_graph()
    rows = ["| package or module | imports from tessera (measured, imports inside functions included) |", "|---|---|"]
    for room in sorted(graph, key=lambda r: (not (PACKAGE / r).is_dir(), r)):
        shown = f"`{room}/`" if (PACKAGE / room).is_dir() else f"`{room}.py`"
        rows.append(f"| {shown} | {', '.join(f'`{t}`' for t in sorted(graph[room])) or 'nothing'} |")
    return "\n".join(rows)


def _table_differences(measured: dict[str, set[str]], documented: dict[str, set[str]]) -> dict[str, dict]:
    return {
        room: {
            "missing": sorted(measured.get(room, set()) - documented.get(room, set())),
            "extra": sorted(documented.get(room, set()) - measured.get(room, set())),
        }
        for room in measured.keys() | documented.keys()
        if measured.get(room) != documented.get(room)
    }


def test_the_architecture_pages_import_table_is_the_measured_one():
    documented = parse_import_table(ARCHITECTURE.read_text(encoding="utf-8"))
    wrong = _table_differences(package_graph(), documented)
    assert not wrong, f"docs/ARCHITECTURE.md's import table differs from the code: {wrong}; it should read:\n" + (
        render_import_table()
    )


def test_the_table_check_fails_on_a_missing_or_extra_import():
    table = render_import_table()
    assert not _table_differences(package_graph(), parse_import_table(table))
    edited = table.replace("| `train/` | `analysis`, ", "| `train/` | ").replace(
        "| `errors.py` | nothing", "| `errors.py` | `model`"
    )
    assert edited != table
    assert set(_table_differences(package_graph(), parse_import_table(edited))) >= {"errors"}


def _layout_block() -> list[str]:
    """The lines of the code block under ``## Layout`` in docs/ARCHITECTURE.md."""
    section = ARCHITECTURE.read_text(encoding="utf-8").split("\n## Layout\n", 1)[1]
    return section.split("```", 2)[1].splitlines()


def documented_layout() -> set[str]:
    """Every ``name.py`` and ``pkg/`` the Layout block names under ``tessera/``, as paths (``train/steps.py``,
    ``hf/families/``): a name on a line indented under ``  pkg/`` belongs to that package."""
    found: set[str] = set()
    packages: list[str] = []  # the enclosing packages at each indent level: ["hf", "families"]
    for line in _layout_block():
        indent = (len(line) - len(line.lstrip(" "))) // 2
        names = line.strip().split("  ")[0].split()
        if indent == 0 or not names or not all(n.endswith((".py", "/")) for n in names):
            continue
        del packages[indent - 1 :]
        for name in names:
            path = "/".join(packages + [name])
            found.add(path)
            if name.endswith("/"):
                packages.append(name.rstrip("/"))
    return found


def test_the_architecture_page_names_every_package_and_module():
    code = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    code |= {
        p.parent.relative_to(PACKAGE).as_posix() + "/" for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE
    }
    named = documented_layout() - {n for n in documented_layout() if n.endswith("__init__.py")}
    assert not code - named, f"docs/ARCHITECTURE.md's Layout does not name: {sorted(code - named)}"
    assert not named - code, f"docs/ARCHITECTURE.md's Layout names what does not exist: {sorted(named - code)}"


# room -> the rooms it must never import (docs/ARCHITECTURE.md's "Layering" rules)
NEVER = {
    "model": {"parallel", "train", "data"},
    "data": {"model", "parallel", "train"},
    "parallel": {"train", "data"},
    "errors": {"*"},
    "dtypes": {"*"},
    "threads": {"*"},
}


def test_the_layering_rules_hold():
    graph = package_graph()
    broken = {
        room: sorted(graph[room] if "*" in never else graph[room] & never)
        for room, never in NEVER.items()
        if (graph[room] if "*" in never else graph[room] & never)
    }
    importers_of_cli = {room for room, targets in graph.items() if "cli" in targets}
    assert not broken, f"layering rules broken (room -> what it must not import): {broken}"
    assert importers_of_cli <= {"__main__", "refdoc"}, sorted(importers_of_cli)
