"""No function or method in tessera/ is longer than 60 lines (docs/ARCHITECTURE.md; COMMON conventions).

Counted with ``ast`` from the ``def`` line to the function's last line (signature, docstring and body;
a nested function counts inside its parent and on its own).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "tessera"
MOST_LINES = 60


def long_functions(source: str, where: str, most: int = MOST_LINES) -> list[str]:
    """``where:line name (N lines)`` for every function of ``source`` longer than ``most`` lines."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > most:
                found.append(f"{where}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_function_in_tessera_is_over_60_lines():
    found = [
        line
        for path in sorted(PACKAGE.rglob("*.py"))
        for line in long_functions(path.read_text(encoding="utf-8"), path.relative_to(PACKAGE.parent).as_posix())
    ]
    assert not found, f"functions over {MOST_LINES} lines (split them): {found}"


def test_a_long_function_is_found():
    body = "".join(f"        x{i} = {i}\n" for i in range(MOST_LINES))
    source = f"def short():\n    return 1\n\n\nclass C:\n    def long(self):\n{body}"
    assert long_functions(source, "m.py") == [f"m.py:6 long ({MOST_LINES + 1} lines)"]
    assert long_functions(source.replace(f"        x{MOST_LINES - 1} = {MOST_LINES - 1}\n", ""), "m.py") == []
