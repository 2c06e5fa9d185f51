"""DeepSpeed's C++ ops, built once into torch's extension directory: say so, and never wait on a dead build's lock.

torch builds an op under a lock file (``<TORCH_EXTENSIONS_DIR>/<python>_<device>/<op>/lock``) that the
building process holds open and removes when it is done. A process killed mid-build leaves the file
behind, and every later build waits on it forever, in silence. Before DeepSpeed starts, each op it will
build is checked: a lock no process on this machine holds open is stale when older than
:data:`STALE_AFTER_S` (removed, with a notice) and refused in one line when younger (it may be another
machine's build on a shared home directory: remove it once no machine is building).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from tessera.errors import UserError

STALE_AFTER_S = 600.0  # an op builds in 1-15 min; a lock no local process holds and this old is a dead build's


def op_names(offload_optimizer: str, offload_params: str, on_cpu: bool) -> list[str]:
    """The ops DeepSpeed builds: shared-memory collectives on CPU, CPU Adam for offload, async I/O for NVMe."""
    devices = {offload_optimizer, offload_params}
    names = ["deepspeed_shm_comm"] if on_cpu else []
    if devices & {"cpu", "nvme"}:
        names.append("cpu_adam")
    if "nvme" in devices:
        names.append("async_io")
    return names


def build_directory(name: str) -> Path:
    """Where torch builds (and caches) the op ``name``."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, False))


def lock_holders(lock: Path) -> list[int]:
    """The pids of processes on this machine that hold ``lock`` open (Linux ``/proc``; [] elsewhere)."""
    target, holders = str(lock.resolve()), []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if any(os.readlink(fd) == target for fd in (proc / "fd").iterdir()):
                holders.append(int(proc.name))
        except OSError:  # gone, or not ours to read
            continue
    return holders


def check_build_lock(directory: Path, now: float | None = None) -> str:
    """A notice when a stale lock in ``directory`` was removed, "" when there is none or a live build holds it.

    Raises a one-line UserError for a lock no local process holds that is too young to call stale.
    """
    lock = directory / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return ""
    if lock_holders(lock):
        return ""
    if age >= STALE_AFTER_S:
        lock.unlink(missing_ok=True)
        return f"tessera: removed the stale DeepSpeed build lock '{lock}' ({age / 60:.0f} min old, held by no process)"
    raise UserError(
        f"DeepSpeed's op build lock '{lock}' is held by no process on this machine ({age:.0f} s old): a build was "
        "killed, or another machine builds into a shared directory; once none is building, remove the file"
    )


def prepare_builds(names: list[str], announce: bool = True) -> None:
    """Clear stale build locks of ``names`` and announce the ops that are not built yet (one line each)."""
    for name in names:
        directory = build_directory(name)
        notice = check_build_lock(directory)
        if announce and notice:
            print(notice, file=sys.stderr, flush=True)
        if announce and not any(directory.glob(f"{name}*.so")):
            print(
                f"tessera: DeepSpeed builds its '{name}' op once (1-15 min, no output meanwhile); it is cached in "
                f"{directory}",
                file=sys.stderr,
                flush=True,
            )
