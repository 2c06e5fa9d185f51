"""Straggler detection: per-rank, per-phase step times, compared across ranks every logging window.

Each rank splits every optimizer step into phases by hooks on the model and optimizer (no edits
to the step itself): ``data`` (step start to the first forward), ``forward``, ``backward`` (forward
end to the next forward or to the optimizer: backward plus the gradient reductions), ``optimizer``
and ``other`` (scheduler, zero_grad, metrics). For each phase it records wall seconds and the
process's CPU seconds (its own work); the difference is time spent waiting, mostly in collectives
(on CPU a rank blocked in a gloo collective uses no CPU), reported as ``collectives``.

Comparing wall time would not find the slow rank: its peers wait for it inside the same phase
(FSDP all-gathers in forward), so every rank's forward looks slow. Own time does find it: once
per logging window the ranks all-gather their per-phase means (one small collective), and a rank
whose own time in a phase exceeds ``log.straggler_ratio`` times the median of the other ranks
(and by at least 5 ms) in ``FLAG_WINDOWS`` windows in a row is flagged, with the phase. Rank 0
writes the latest table to ``RUN/stragglers.json`` (``tessera status`` prints it).

CPU time is the own-work measure on CPU processes; on CUDA the host's CPU time is not the device's
work (kernels are asynchronous), so there the comparison is of wall time per phase, which names the
rank but can blame the waiting peers' phase too (NVRx times kernels with CUDA events instead).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tessera.train.straggler_table import COMPUTE, PHASES, TABLE

FLAG_WINDOWS = 3  # consecutive windows a rank must be slowest in before it is flagged
MIN_EXCESS_S = 0.005  # a phase's own time must exceed the peers' by this much too (timer noise)


@dataclass
class PhaseClock:
    """This rank's phase seconds (wall and CPU) summed over the current window."""

    wall: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    cpu: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    phase: str = "data"
    since: tuple[float, float] = (0.0, 0.0)
    steps: int = 0

    def enter(self, phase: str) -> None:
        """Close the running phase and start ``phase``."""
        now = (time.perf_counter(), time.process_time())
        if self.since != (0.0, 0.0):
            self.wall[self.phase] += now[0] - self.since[0]
            self.cpu[self.phase] += now[1] - self.since[1]
        self.phase, self.since = phase, now

    def row(self) -> list[float]:
        """Per-step means: wall seconds of each phase, then CPU seconds of each phase."""
        n = max(self.steps, 1)
        return [self.wall[p] / n for p in PHASES] + [self.cpu[p] / n for p in PHASES]


class StragglerDetector:
    """Times this rank's phases and, every ``every`` steps, flags a consistently slower rank (see module doc)."""

    def __init__(self, run_dir: str | Path, ratio: float, every: int, rank: int, world: int, device: torch.device):
        self.path = Path(run_dir) / TABLE
        self.ratio, self.every, self.rank, self.world, self.device = ratio, every, rank, world, device
        self.clock = PhaseClock()
        self.streak: dict[tuple[int, str], int] = {}
        self.flagged: dict[int, str] = {}  # rank -> phase, once flagged
        self.use_cpu = device.type == "cpu"

    @property
    def enabled(self) -> bool:
        """Off for one process or ``log.straggler_ratio=0``."""
        return self.world > 1 and self.ratio > 0

    def attach(self, model: nn.Module, optimizer: Any) -> None:
        """Hooks that mark the phase boundaries (the forward's first, before FSDP's all-gather)."""
        if not self.enabled:
            return
        model.register_forward_pre_hook(lambda *_: self.clock.enter("forward"), prepend=True)
        model.register_forward_hook(lambda *_: self.clock.enter("backward"))
        if hasattr(optimizer, "register_step_pre_hook"):
            optimizer.register_step_pre_hook(lambda *_: self.clock.enter("optimizer"))
            optimizer.register_step_post_hook(lambda *_: self.clock.enter("other"))

    def start_step(self) -> None:
        """A step begins (its first phase is data)."""
        if self.enabled:
            self.clock.enter("data")

    def end_step(self, step: int, window_ends: bool) -> dict[str, Any] | None:
        """Close the step; at a window's end (every rank: a collective) return a new flag's record, else None."""
        if not self.enabled:
            return None
        self.clock.enter("data")
        self.clock.steps += 1
        if not window_ends:
            return None
        rows = self._gather(self.clock.row())
        self.clock = PhaseClock(phase="data", since=self.clock.since)
        table = self._table(rows)
        record = self._judge(step, table)
        if self.rank == 0:
            payload = {"step": step, "ratio": self.ratio, "flagged": self.flagged, "ranks": table}
            self.path.write_text(json.dumps(payload, indent=1), encoding="utf-8")
        return record

    def _gather(self, row: list[float]) -> list[list[float]]:
        mine = torch.tensor(row, dtype=torch.float64, device=self.device)
        out = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(out, mine)
        return [t.tolist() for t in out]

    def _table(self, rows: list[list[float]]) -> list[dict[str, float]]:
        """Per rank: step seconds, own seconds per phase, and seconds waited (collectives)."""
        n = len(PHASES)
        table = []
        for row in rows:
            wall, cpu = row[:n], row[n:]
            own = cpu if self.use_cpu else wall
            entry = {"step_s": sum(wall), **{p: own[i] for i, p in enumerate(PHASES)}}
            entry["collectives"] = max(0.0, sum(wall) - sum(cpu)) if self.use_cpu else 0.0
            table.append(entry)
        return table

    def _judge(self, step: int, table: list[dict[str, float]]) -> dict[str, Any] | None:
        new = None
        for rank, entry in enumerate(table):
            for phase in COMPUTE:
                median = statistics.median(t[phase] for i, t in enumerate(table) if i != rank)
                slow = entry[phase] > self.ratio * median and entry[phase] - median > MIN_EXCESS_S
                key = (rank, phase)
                self.streak[key] = self.streak.get(key, 0) + 1 if slow else 0
                if self.streak[key] == FLAG_WINDOWS and self.flagged.get(rank) != phase:
                    self.flagged[rank] = phase
                    new = {"rank": rank, "phase": phase, "seconds": entry[phase], "others_median_s": median}
        return {"step": step, "straggler": new} if new else None


def describe(flag: dict[str, Any], windows: int = FLAG_WINDOWS) -> str:
    """One console line for a flagged rank."""
    return (
        f"straggler: rank {flag['rank']} is slower in {flag['phase']} ({1e3 * flag['seconds']:.1f} ms per step vs "
        f"{1e3 * flag['others_median_s']:.1f} ms median of the other ranks, {windows} logging windows in a row)"
    )
