"""The `tessera ...` commands a documentation page shows (stdlib only: the README runner uses it in a
base install, before the dev extras exist)."""

from __future__ import annotations

import re

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
INLINE = re.compile(r"(?<!`)`(tessera [^`]+)`(?!`)")
SYNOPSIS = re.compile(r"[\[\]|<>]|\.\.\.|(?<![\w.=/-])[A-Z][A-Z_]*(?![\w.=/-])")  # CONFIG, [SECTION], K: a synopsis
INVOCATION = re.compile(r" \S*[/=]")  # a path or a key=value: a command to run, not a command's name


def fenced_commands(text: str) -> list[str]:
    """`tessera ...` lines of code blocks (a `$ ` prompt and `\\` continuations understood)."""
    out = []
    for block in FENCE.findall(text):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.strip().removeprefix("$ ")
            for part in re.split(r"\s*(?:&&|\|\||;|\|)\s*", line):
                if re.match(r"(\.venv/bin/)?tessera [a-z]", part) and not part.split()[1].endswith(":"):
                    out.append(part.split(" #", 1)[0].strip())
    return out


def inline_commands(text: str) -> list[str]:
    """`tessera ...` spans in the prose that are invocations (a path or key=value), not synopses."""
    return [" ".join(c.split()) for c in INLINE.findall(FENCE.sub("", text)) if _invocation(c)]


def commands_in_order(text: str) -> list[str]:
    """Every command of a page, fenced and inline, in the order a reader meets them."""
    found = [((m.start(), i), c) for m in FENCE.finditer(text) for i, c in enumerate(fenced_commands(m.group(0)))]
    prose = FENCE.sub(lambda m: " " * len(m.group(0)), text)
    found += [((m.start(), 0), " ".join(m.group(1).split())) for m in INLINE.finditer(prose) if _invocation(m.group(1))]
    return [c for _, c in sorted(found)]


def _invocation(command: str) -> bool:
    return bool(INVOCATION.search(command)) and not SYNOPSIS.search(command)
