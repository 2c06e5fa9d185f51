"""The lock that says a process holds a run directory.

While a training runs, its rank 0 holds ``RUN_DIR/run.lock``: an exclusive ``flock`` on the file
(released by the kernel when the process dies, however it dies) whose JSON content names the
holder (pid, host, start time) and is refreshed at every logged step. On the same machine the
flock is the truth; a holder on another machine (a SLURM job seen from the login node, where a
shared filesystem may not carry locks) is recognised by a heartbeat younger than
:data:`HEARTBEAT_STALE_S`. Nothing here imports torch, so ``tessera status`` is instant.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TextIO

from tessera.errors import ConfigError

LOCK_NAME = "run.lock"
HEARTBEAT_STALE_S = 600.0  # a remote holder silent this long is presumed gone


@dataclass(frozen=True)
class Holder:
    """The process that holds a run: who, where, since when, and how far it got."""

    pid: int
    host: str
    started: float
    updated: float
    step: int
    remote: bool  # True when only the heartbeat (not a lock on this machine) says it is alive

    def describe(self) -> str:
        """``"pid 123 on host n1, step 40, started 2m10s ago"``."""
        where = f"pid {self.pid} on host {self.host}"
        seen = f", last heartbeat {duration(time.time() - self.updated)} ago" if self.remote else ""
        return f"{where}, step {self.step}, started {duration(time.time() - self.started)} ago{seen}"


def duration(seconds: float) -> str:
    """``"45s"``, ``"3m07s"``, ``"2h05m"``, ``"3d04h"``."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


class RunLock:
    """Held by rank 0 of a training for its whole duration; see the module doc.

    Re-entrant within a process: ``tessera train`` claims the run before anything is built
    (:func:`claim_run`) and the metrics logger joins that claim; the lock is dropped when the
    last holder releases it.
    """

    _held: ClassVar[dict[Path, RunLock]] = {}

    def __init__(self, run_dir: str | Path) -> None:
        self.path = (Path(run_dir) / LOCK_NAME).absolute()
        self.file: TextIO | None = None
        self.info: dict[str, Any] = {}
        self.holders = 0

    def acquire(self) -> RunLock:
        """Take the lock (or join this process's hold on it); a ConfigError names another holder."""
        held = RunLock._held.get(self.path)
        if held is not None:
            held.holders += 1
            return held
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            file = open(self.path, "a+")  # noqa: SIM115 (held open until release: the flock lives on it)
        except OSError as err:
            raise ConfigError(_unusable_run_dir(self.path.parent, err)) from None
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.close()
            holder = run_holder(self.path.parent, trust_heartbeat=False)
            raise ConfigError(in_use_message(self.path.parent, holder, "this training")) from None
        except OSError:
            pass  # a filesystem without locks: keep the heartbeat only
        now = time.time()
        self.file, self.holders = file, 1
        self.info = {"pid": os.getpid(), "host": socket.gethostname(), "started": now, "updated": now, "step": 0}
        self.info["state"] = "running"
        RunLock._held[self.path] = self
        self._write()
        return self

    def _write(self) -> None:
        if self.file is None:
            return
        # In place (same inode): replacing the file would leave the flock on the old one.
        self.file.seek(0)
        self.file.truncate()
        self.file.write(json.dumps(self.info) + "\n")
        self.file.flush()

    def heartbeat(self, step: int) -> None:
        """Record progress (``tessera status`` and the SLURM launcher read it)."""
        self.info.update(step=step, updated=time.time())
        self._write()

    def release(self) -> None:
        """Leave the hold; the last holder marks the run as ended and drops the lock."""
        self.holders -= 1
        if self.holders > 0 or self.file is None:
            return
        RunLock._held.pop(self.path, None)
        self.info.update(state="ended", updated=time.time())
        self._write()
        self.file.close()
        self.file = None


def _unusable_run_dir(run_dir: Path, err: OSError) -> str:
    if run_dir.exists() and not run_dir.is_dir():
        return f"train.run_dir '{run_dir}' is a file, not a directory; choose another train.run_dir"
    return f"train.run_dir '{run_dir}' is not writable ({err.strerror}); choose a writable train.run_dir"


def read_json(path: Path) -> dict[str, Any]:
    """A run directory's small JSON file, or {} when it is absent, being rewritten or not ours."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # being rewritten, or not ours


def _locked_here(path: Path) -> bool | None:
    """Whether a process holds the flock (None: this filesystem cannot tell)."""
    try:
        with open(path) as file:
            try:
                fcntl.flock(file, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(file, fcntl.LOCK_UN)
            return False
    except OSError:
        return None


def run_holder(run_dir: str | Path, trust_heartbeat: bool = True) -> Holder | None:
    """The process training in ``run_dir`` now, or None.

    ``trust_heartbeat`` also believes a recent heartbeat from another machine (see the module
    doc); a training that restarts on another node must not, so it passes False.
    """
    path = Path(run_dir) / LOCK_NAME
    if not path.is_file():
        return None
    locked, info = _locked_here(path), read_json(path)
    holder = Holder(
        int(info.get("pid", 0)),
        str(info.get("host", "?")),
        float(info.get("started", 0)),
        float(info.get("updated", 0)),
        int(info.get("step", 0)),
        remote=not locked,
    )
    if locked:
        return holder
    other_host = info.get("host") != socket.gethostname() or locked is None
    fresh = time.time() - holder.updated < HEARTBEAT_STALE_S
    if trust_heartbeat and info.get("state") == "running" and other_host and fresh:
        return holder
    return None


def in_use_message(run_dir: Path, holder: Holder | None, what: str) -> str:
    """The one-line refusal when ``run_dir`` is held."""
    who = holder.describe() if holder else "another process"
    hint = f"if that process is gone, delete {run_dir / LOCK_NAME}; " if holder and holder.remote else ""
    return (
        f"train.run_dir '{run_dir}' belongs to a training that is still running ({who}); "
        f"{hint}wait for it, stop it, or set another train.run_dir for {what}"
    )


def refuse_if_running(run_dir: str | Path, what: str, trust_heartbeat: bool = False) -> None:
    """ConfigError when a training holds ``run_dir`` (``what`` names the refused command)."""
    holder = run_holder(run_dir, trust_heartbeat)
    if holder is not None:
        raise ConfigError(in_use_message(Path(run_dir), holder, what))
