"""Run every `tessera ...` command README.md shows, in the order a reader meets them, in the current
environment: `.ci/run` calls it in a fresh virtual environment right after the base install
(`pip install torch==2.13.0 -e .`), so a command that needs an undeclared dependency or a dev extra
fails CI. Each command's wall time is printed; the first failure stops the run with its output.

    python tests/readme_commands.py [--dry-run]
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from helpers.doc_commands import commands_in_order  # noqa: E402 (tests/ on the path first)


def readme_commands() -> list[str]:
    """The README's commands, in reading order (the smoke run comes before the commands that read it)."""
    return commands_in_order((REPO / "README.md").read_text(encoding="utf-8"))


def main(argv: list[str]) -> int:
    """Run each command from the repository root; exit 1 at the first that fails."""
    commands = readme_commands()
    fresh_runs = not (REPO / "runs").exists()  # the smoke run writes runs/smoke; tests assume a clean checkout
    if len(commands) < 5 or commands[0] != "tessera train configs/smoke.toml":
        print(f"readme_commands: expected the smoke run first and 5+ commands, found {commands}", file=sys.stderr)
        return 1
    for command in commands:
        if "--dry-run" in argv:
            print(command)
            continue
        start = time.perf_counter()
        done = subprocess.run(shlex.split(command), cwd=REPO, capture_output=True, text=True)
        print(f"readme: {time.perf_counter() - start:7.1f} s  exit {done.returncode}  {command}", flush=True)
        if done.returncode:
            print(done.stdout[-4000:], done.stderr[-4000:], sep="\n", file=sys.stderr)
            return 1
    if fresh_runs and "--dry-run" not in argv:
        shutil.rmtree(REPO / "runs", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
