"""How many CPU threads each training process gives torch.

On a CPU, torch's default (every core) is wrong as soon as several processes share a node (each
one spins up a thread per core and they fight) and slow on a busy machine. tessera picks:

1. ``train.threads`` when it is > 0;
2. else ``OMP_NUM_THREADS`` when it is set (an explicit choice; torchrun sets it to 1 when it
   starts several processes and it is unset, and ``tessera launch`` sets it to the share below);
3. else the cores this process may use (``os.sched_getaffinity`` and the cgroup CPU quota)
   divided by the processes on this node (``LOCAL_WORLD_SIZE``), at least 1; but one thread when
   the machine is already busier than its cores at start (1-minute load above cores + 0.5): threads
   that wait for a core at every parallel region cost more than they give (measured in issue 37: the
   smoke job took 1,025 s with 2 threads and 180 s with 1 at load 3-7 on 2 cores).

The choice is printed in the training banner, with a hint when the machine's load says other
processes are using the same cores.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ThreadChoice:
    """The thread count of one process and why."""

    threads: int
    reason: str

    def describe(self) -> str:
        """``"2 torch threads per process (auto: 2 cores / 1 process; train.threads sets it)"``."""
        plural = "s" if self.threads != 1 else ""
        return f"{self.threads} torch thread{plural} per process ({self.reason}; train.threads sets it)"


def _cgroup_cores(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The cgroup v2 (or v1) CPU quota in cores, or None when unlimited or unknown."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota_us / period_us if quota_us > 0 else None
    except (OSError, ValueError):
        return None


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by the cgroup quota."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cgroup_cores()
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores)


def choose_threads(configured: int, local_processes: int, environ: dict[str, str] | None = None) -> ThreadChoice:
    """The thread count for one of ``local_processes`` processes on this node (see the module doc)."""
    env = os.environ if environ is None else environ
    if configured > 0:
        return ThreadChoice(configured, "train.threads")
    omp = env.get("OMP_NUM_THREADS", "").strip()
    if omp.isascii() and omp.isdigit() and int(omp) > 0:
        return ThreadChoice(int(omp), "OMP_NUM_THREADS")
    cores, procs = usable_cores(), max(1, local_processes)
    per_process = max(1, cores // procs)
    load = machine_load_if_busy()
    if load is not None and per_process > 1:  # issue 37: smoke job 1,025 s at 2 threads, 180 s at 1 (load 3-7)
        return ThreadChoice(1, f"auto: machine busy, load {load:.1f} on {cores} core{'s' if cores != 1 else ''}")
    return ThreadChoice(
        per_process, f"auto: {cores} core{'s' if cores != 1 else ''} / {procs} process{'es' if procs != 1 else ''}"
    )


def machine_load_if_busy() -> float | None:
    """The 1-minute load average when more work is runnable than there are usable cores, else None."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return load if load > usable_cores() + 0.5 else None


def busy_hint(threads: int) -> str:
    """A hint when the machine is busier than its cores (empty otherwise, and for one thread)."""
    load = machine_load_if_busy()
    if threads <= 1 or load is None:
        return ""
    return f"machine busy (load {load:.1f} on {usable_cores()} cores): if steps are slow, try train.threads=1"


def apply_threads(configured: int, local_processes: int) -> ThreadChoice:
    """Choose the thread count and give it to torch (intra-op; inter-op stays torch's)."""
    import torch

    choice = choose_threads(configured, local_processes)
    torch.set_num_threads(choice.threads)
    return choice
