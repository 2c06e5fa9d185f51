"""Deliberate faults for the resilience tests: ``$TESSERA_FAULTS``, read here only.

A comma-separated list of ``KIND@WHERE`` items; nothing is injected when the variable is unset:

- ``corrupt_batch@STEP``: the micro-batches an uninterrupted run reads at optimizer step STEP
  (1-based; the fault follows the data, so a rollback that skips them never sees it) get random
  tokens with every label set to the rarest-looking id (the last of the vocabulary), a batch no
  real corpus produces: the loss and gradient norm jump (tests of ``train.on_spike``).
- ``slow_forward@RANK:SECONDS``: global rank RANK computes (spins) SECONDS of CPU time at the
  start of every forward, as a slower device would (tests of straggler detection).
- ``hang@RANK:STEP``: global rank RANK stops at the start of step STEP and sleeps for an hour
  (tests of the hang report: its peers wait in the step's first collective).
- ``die@RANK:STEP``: global rank RANK SIGKILLs itself in its first forward of a step >= STEP (inside
  the step: under torchft its peers' gradient allreduce of that step then fails).
- ``pace@SECONDS``: every rank sleeps SECONDS at the start of every step (idle, no CPU), so a tiny
  run lasts long enough for the fault-tolerance tests to kill and restart a replica group in it.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import torch

ENV = "TESSERA_FAULTS"


@dataclass
class Faults:
    """The parsed ``$TESSERA_FAULTS`` of this process."""

    corrupt_steps: set[int] = field(default_factory=set)
    slow_forward: dict[int, float] = field(default_factory=dict)  # rank -> seconds per forward
    hang: dict[int, int] = field(default_factory=dict)  # rank -> step
    pace: float = 0.0  # seconds slept at the start of every step
    die: dict[int, int] = field(default_factory=dict)  # rank -> step
    step: int = 0  # the step being trained (set at its start)

    @classmethod
    def from_env(cls) -> Faults:
        """The faults ``$TESSERA_FAULTS`` asks for (none when unset)."""
        faults = cls()
        for item in filter(None, (s.strip() for s in os.environ.get(ENV, "").split(","))):
            kind, _, where = item.partition("@")
            if kind == "corrupt_batch":
                faults.corrupt_steps.add(int(where))
            elif kind == "pace":
                faults.pace = float(where)
            elif kind in ("slow_forward", "hang", "die"):
                rank, _, value = where.partition(":")
                if kind in ("hang", "die"):
                    getattr(faults, kind)[int(rank)] = int(value)
                else:
                    faults.slow_forward[int(rank)] = float(value)
            else:
                raise ValueError(f"${ENV}: unknown fault {kind!r} (corrupt_batch, slow_forward, hang, pace, die)")
        return faults

    def corrupt(self, step: int, batch: Any, vocab_size: int) -> Any:
        """A micro-batch (a :class:`~tessera.data.batch.Batch`) of ``step``, corrupted when that step is listed."""
        if step not in self.corrupt_steps:
            return batch
        gen = torch.Generator().manual_seed(step)
        bad = torch.randint(0, vocab_size, batch.tokens.shape, generator=gen, dtype=batch.tokens.dtype)
        bad[:, 1::2] = vocab_size - 1
        return dataclasses.replace(batch, tokens=bad)

    def attach(self, model: torch.nn.Module, rank: int) -> None:
        """Make this rank's forward slow when it is the listed slow one."""
        if rank in self.slow_forward:
            seconds = self.slow_forward[rank]
            model.register_forward_pre_hook(lambda *_: _spin(seconds))
        if rank in self.die:
            model.register_forward_pre_hook(lambda *_: self._maybe_die(self.die[rank]))

    def _maybe_die(self, step: int) -> None:
        if self.step >= step:
            os.kill(os.getpid(), signal.SIGKILL)

    def maybe_hang(self, rank: int, step: int) -> None:
        """Stop this rank for an hour at ``step`` when listed (its peers then wait in a collective); ``pace``."""
        self.step = step
        if self.pace:
            time.sleep(self.pace)
        if self.hang.get(rank) == step:
            time.sleep(3600)


def _spin(seconds: float) -> None:
    """Busy CPU work for ``seconds`` of this process's CPU time."""
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass
