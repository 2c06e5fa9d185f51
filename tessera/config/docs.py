"""Documentation of every recipe key, generated from the config dataclasses so it cannot drift.

A key's type, default and allowed values come from its dataclass field; its meaning from the
field's ``metadata["doc"]`` or, as tessera writes them, the comment at the end of the field's
line in the source (read with :mod:`tokenize` and :mod:`ast`, not by hand). A field whose type
is itself a dataclass is a sub-section (``[model.attention]``) and is walked the same way.
``tessera config keys [SECTION]`` prints :func:`keys_table`; ``tessera train --print-config``
prints :func:`commented_toml`.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import io
import tokenize
import typing
from dataclasses import dataclass
from typing import Any, Literal

from tessera.config.job import JobConfig, toml_string
from tessera.errors import ConfigError


@dataclass(frozen=True)
class KeyDoc:
    """One recipe key: dotted name, type text, allowed values, value and meaning."""

    key: str
    type: str
    choices: tuple[Any, ...]
    value: Any  # the default (or, for commented_toml, the config's value)
    comment: str


@dataclass(frozen=True)
class SectionDoc:
    """A ``[section]`` or ``[section.sub]`` table: its dotted name, docstring and keys (sub-sections apart)."""

    name: str
    doc: str
    keys: tuple[KeyDoc, ...]


@functools.cache
def _source_comments(path: str) -> dict[int, str]:
    """Line number -> the comment on that line of a source file."""
    with open(path, encoding="utf-8") as f:
        tokens = tokenize.generate_tokens(io.StringIO(f.read()).readline)
        return {tok.start[0]: tok.string.lstrip("#").strip() for tok in tokens if tok.type == tokenize.COMMENT}


def _first_comment(comments: dict[int, str], first: int, last: int) -> str:
    """The first comment on lines ``first..last`` (a field a formatter wrapped keeps its comment inside)."""
    return next((comments[line] for line in range(first, last + 1) if line in comments), "")


@functools.cache
def field_comments(cls: type) -> dict[str, str]:
    """Field name -> the comment on its definition's line(s) in ``cls``'s source ("" when none)."""
    path = inspect.getsourcefile(cls)
    if path is None:
        return {}
    comments = _source_comments(path)
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            return {
                stmt.target.id: _first_comment(comments, stmt.lineno, stmt.end_lineno or stmt.lineno)
                for stmt in node.body
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
            }
    return {}


def _type_text(hint: Any) -> tuple[str, tuple[Any, ...]]:
    if typing.get_origin(hint) is Literal:
        choices = typing.get_args(hint)
        return " | ".join(str(c) for c in choices), choices
    return getattr(hint, "__name__", str(hint)), ()


def _is_section(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def sections(cls: type = JobConfig, instance: Any = None, prefix: str = "") -> list[SectionDoc]:
    """Every table of ``cls`` (a nested dataclass tree), parents before their sub-sections."""
    instance = instance if instance is not None else cls()
    hints = typing.get_type_hints(cls)
    out: list[SectionDoc] = []
    for f in dataclasses.fields(cls):
        if _is_section(hints[f.name]):
            out += _section(f"{prefix}{f.name}", hints[f.name], getattr(instance, f.name))
    return out


def _section(name: str, cls: type, instance: Any) -> list[SectionDoc]:
    hints, comments = typing.get_type_hints(cls), field_comments(cls)
    keys, subs = [], []
    for f in dataclasses.fields(cls):
        value = getattr(instance, f.name)
        if _is_section(hints[f.name]):
            subs += _section(f"{name}.{f.name}", hints[f.name], value)
            continue
        type_text, choices = _type_text(hints[f.name])
        comment = str(f.metadata.get("doc", "")) or comments.get(f.name, "")
        keys.append(KeyDoc(f"{name}.{f.name}", type_text, choices, value, comment))
    doc = (inspect.getdoc(cls) or "").split("\n")[0].removeprefix(f"[{name}]:").strip()
    return [SectionDoc(name, doc, tuple(keys)), *subs]


def toml_value(value: Any) -> str:
    """``value`` written as TOML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return repr(value) if isinstance(value, float) else str(value)


def _select(name: str) -> list[SectionDoc]:
    """The sections a ``tessera config keys NAME`` filter picks (all for ""), or a ConfigError."""
    every = sections()
    if not name:
        return every
    picked = [s for s in every if s.name == name or s.name.startswith(name + ".")]
    if picked:
        return picked
    for s in every:
        keys = tuple(k for k in s.keys if k.key == name)
        if keys:
            return [SectionDoc(s.name, s.doc, keys)]
    known = [s.name for s in every] + [k.key for s in every for k in s.keys]
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise ConfigError(f"no config section or key '{name}'{hint}; sections: {', '.join(s.name for s in every)}")


def keys_table(name: str = "") -> str:
    """Every key under ``name`` (a section, sub-section or key; all when empty): type, default, meaning."""
    blocks = []
    for section in _select(name):
        width = max((len(k.key) + 3 + len(toml_value(k.value)) for k in section.keys), default=0)
        lines = [f"[{section.name}]  {section.doc}".rstrip()]
        for k in section.keys:
            assignment = f"{k.key} = {toml_value(k.value)}".ljust(width)
            kind = f"one of {k.type}" if k.choices else k.type
            lines.append(f"  {assignment}  ({kind}){'  ' + k.comment if k.comment else ''}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def commented_toml(config: JobConfig) -> str:
    """The resolved ``config`` as a TOML recipe with each key's comment (and allowed values)."""
    blocks = []
    for section in sections(JobConfig, config):
        lines = [f"# {section.doc}" if section.doc else "", f"[{section.name}]"]
        for k in section.keys:
            notes = "; ".join(x for x in (k.type if k.choices else "", k.comment) if x)
            lines.append(f"{k.key.rsplit('.', 1)[1]} = {toml_value(k.value)}{'  # ' + notes if notes else ''}")
        blocks.append("\n".join(line for line in lines if line))
    return "\n\n".join(blocks) + "\n"
