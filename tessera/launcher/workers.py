"""User errors out of torchrun workers: each worker writes its one line to a file; the launcher prints it once.

Without this, a worker's ``tessera: error: ...`` is followed by torchrun's many-line ``ChildFailedError``
report and exit code 1. ``tessera launch`` runs torchrun in-process with :data:`ERROR_DIR_ENV` naming a
private folder; a worker that fails on a user error writes ``rank<RANK>.txt`` there (and prints nothing);
the launcher catches torchrun's report and ends with one line naming the rank(s), exit code 2.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from pathlib import Path

ERROR_DIR_ENV = "TESSERA_WORKER_ERRORS"


def record_worker_error(message: str) -> bool:
    """Under ``tessera launch``: write this worker's user error for the launcher and return True (else False)."""
    folder = os.environ.get(ERROR_DIR_ENV, "")
    rank = os.environ.get("RANK", "")
    if not folder or not rank or not Path(folder).is_dir():
        return False
    (Path(folder) / f"rank{rank}.txt").write_text(message, encoding="utf-8")
    return True


def peer_failed() -> bool:
    """Under ``tessera launch``: has another worker already stopped on a user error (so this one's crash follows)?"""
    folder = os.environ.get(ERROR_DIR_ENV, "")
    mine = f"rank{os.environ.get('RANK', '')}.txt"
    return bool(folder) and any(f.name != mine for f in Path(folder).glob("rank*.txt"))


class _AfterUserErrorFilter(logging.Filter):
    """Drops torchrun's agent log lines (worker failed, closing signal) once a worker has written a user error."""

    def __init__(self, folder: str) -> None:
        super().__init__()
        self.folder = Path(folder)

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(self.folder.glob("rank*.txt"))


def worker_error_line(folder: Path) -> str:
    """One line for the user errors the workers wrote (the earliest message, with the ranks that gave it)."""
    files = sorted(folder.glob("rank*.txt"), key=lambda f: f.stat().st_mtime)
    if not files:
        return ""
    messages = {f: f.read_text(encoding="utf-8", errors="replace").strip() for f in files}
    first = messages[files[0]]
    ranks = sorted(int(f.stem.removeprefix("rank")) for f, text in messages.items() if text == first)
    others = len(files) - len(ranks)
    where = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
    more = f" ({others} other rank(s) failed differently)" if others else ""
    return f"tessera: error: {where}: {first}{more}"


def run_torchrun(argv: list[str], env: dict[str, str]) -> int:
    """Run torchrun (``torch.distributed.run``) in this process with ``argv``; a worker's user error -> exit 2.

    Any other failure is torchrun's own report, unchanged.
    """
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = torchrun.parse_args(argv)
    os.environ.update(env)
    with tempfile.TemporaryDirectory(prefix="tessera-worker-errors-") as folder:
        os.environ[ERROR_DIR_ENV] = folder
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_AfterUserErrorFilter(folder))
        try:
            torchrun.run(args)
        except ChildFailedError:
            line = worker_error_line(Path(folder))
            if not line:
                raise
            print(line, file=sys.stderr, flush=True)
            return 2
        finally:
            os.environ.pop(ERROR_DIR_ENV, None)
    return 0
