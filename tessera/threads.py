"""How many CPU threads each training process gives torch.

On a CPU, torch's default (every core) is wrong as soon as several processes share a node (each
one spins up a thread per core and they fight) and slow on a busy machine. tessera picks:

1. ``train.threads`` when it is > 0;
2. else ``OMP_NUM_THREADS`` when it is set (an explicit choice; torchrun sets it to 1 when it
   starts several processes and it is unset, and ``tessera launch`` sets it to the share below);
3. else the cores this process may use (``os.sched_getaffinity`` and the cgroup CPU quota)
   divided by the processes on this node (``LOCAL_WORLD_SIZE``), at least 1, **minus the cores
   other work keeps busy right now** (sampled from ``/proc/stat`` over a quarter second at start;
   the 1-minute load average where there is no ``/proc``): a thread that has to wait for a core
   at every parallel region stalls all the others at the region's barrier.
   ``benchmarks/threads.py`` measured the smoke job on 2 cores (docs/getting-started.md): with
   one other busy process, 2 threads took 2.3-5.4x the time of 1 (two runs); with two, 4.7-6.0x;
   idle, 1 thread took 1.8x the time of 2. The rule picks the faster choice at every load measured.

The choice is printed in the training banner, with a hint when ``train.threads`` asks for more
threads than the machine has free cores.
"""

from __future__ import annotations

import math
import os
import time
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
    if per_process == 1:
        return ThreadChoice(1, f"auto: {_cores(cores)} / {procs} process{'es' if procs != 1 else ''}")
    busy = other_work()
    free = max(1, min(per_process, math.floor((cores - busy) / procs + 0.25)))
    if free < per_process:
        return ThreadChoice(free, f"auto: {busy:.1f} of {_cores(cores)} busy with other work")
    return ThreadChoice(per_process, f"auto: {_cores(cores)} / {procs} process{'es' if procs != 1 else ''}")


def _cores(n: int) -> str:
    return f"{n} core{'s' if n != 1 else ''}"


def _cpu_jiffies(stat: Path = Path("/proc/stat")) -> tuple[int, int] | None:
    """(busy, total) CPU time of the whole machine in clock ticks, or None without ``/proc/stat``."""
    try:
        fields = [int(x) for x in stat.read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already counted in user
    return total - idle, total


def other_work(window: float = 0.25) -> float:
    """Cores' worth of work other processes run right now: the machine's busy CPU time over ``window``
    seconds less this process's own, in cores (the 1-minute load average where ``/proc/stat`` is absent)."""
    before, own = _cpu_jiffies(), time.process_time()
    if before is None:
        return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    time.sleep(window)
    after, own = _cpu_jiffies(), time.process_time() - own
    if after is None or after[1] <= before[1]:
        return 0.0
    machine_cores = os.cpu_count() or 1
    busy = (after[0] - before[0]) / (after[1] - before[1]) * machine_cores
    return max(0.0, busy - own / window)


def machine_busy(peers: int = 0) -> float | None:
    """Cores' worth of other work beyond ``peers`` cores (this job's other local processes) when it is at least
    half a core (a probe or a thread would feel it), else None."""
    busy = other_work() - peers
    return busy if busy >= 0.5 else None


def busy_hint(threads: int) -> str:
    """A hint when more threads were asked for than the machine has free cores (empty otherwise)."""
    if threads <= 1:
        return ""
    busy = machine_busy()
    if busy is None or usable_cores() - busy >= threads - 0.25:
        return ""
    cores = _cores(usable_cores())
    return f"machine busy ({busy:.1f} of {cores} running other work): if steps are slow, try train.threads=1"


def apply_threads(configured: int, local_processes: int) -> ThreadChoice:
    """Choose the thread count and give it to torch (intra-op; inter-op stays torch's)."""
    import torch

    choice = choose_threads(configured, local_processes)
    torch.set_num_threads(choice.threads)
    return choice
