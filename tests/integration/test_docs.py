"""The documentation: every `tessera ...` command in README.md and docs/ parses with the real parser,
the generated reference pages are current, and every CLI option says its default in ``--help``."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

import pytest

from tessera.cli import _all_parsers, _unknown_flags, build_parser
from tessera.config import ConfigError
from helpers.doc_commands import fenced_commands, inline_commands

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _commands() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        if page.parent.name == "reference":  # generated from the parser itself
            continue
        text = page.read_text(encoding="utf-8")
        found += [(str(page.relative_to(REPO)), c) for c in fenced_commands(text) + inline_commands(text)]
    return found


COMMANDS = _commands()


def _parses(command: str) -> None:
    argv = shlex.split(command)[1:]
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
    except SystemExit as exit_:
        pytest.fail(f"argparse refuses `{command}` (exit {exit_.code})")
    if getattr(args, "passthrough", False):  # `tessera lm-eval` hands its flags to lm-eval, as main() does
        return
    try:
        _unknown_flags(parser, extra)
    except ConfigError as err:
        pytest.fail(f"`{command}`: {err}")


def test_the_docs_show_many_commands():
    assert len(COMMANDS) > 40 and {p for p, _ in COMMANDS} >= {"README.md", "docs/getting-started.md"}


@pytest.mark.parametrize("page,command", COMMANDS, ids=[f"{p}:{c[:60]}" for p, c in COMMANDS])
def test_every_documented_command_parses(page, command):
    _parses(command)


def test_a_wrong_command_is_caught():
    with pytest.raises(pytest.fail.Exception):
        _parses("tessera train configs/smoke.toml --max-stepz 3")


def test_generated_reference_pages_are_current():
    from tessera.refdoc import stale_pages

    assert stale_pages() == [], "stale generated docs: run `python -m tessera.refdoc` and commit docs/reference/"


def test_every_option_shows_its_default_in_help():
    missing = []
    for parser in _all_parsers(build_parser()):
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or isinstance(action, (argparse._HelpAction, argparse._StoreTrueAction)):
                continue
            if not action.help or "default" not in formatter._expand_help(action):
                missing.append(f"{parser.prog} {action.option_strings[-1]}")
    assert not missing, f"options whose --help hides the default: {missing}"
