"""When to checkpoint: every ``checkpoint.every`` steps, after the last step, and every ``checkpoint.every_minutes``.

The wall-clock rule is decided collectively: each rank compares its own clock with the time of
its last save and one all-reduce (MAX) of those flags gives every rank the same answer, so all
ranks save the same step even when their clocks or speeds differ. Without ``every_minutes`` no
collective is added to the step.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist


class SaveSchedule:
    """Answers "save after this step?" the same way on every rank (see the module doc)."""

    def __init__(
        self,
        every: int,
        every_minutes: float,
        total_steps: int,
        enabled: bool = True,
        device: torch.device | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.every, self.seconds, self.total_steps, self.enabled = every, every_minutes * 60, total_steps, enabled
        self.device = device or torch.device("cpu")
        self.clock = clock
        self.last_save = clock()

    def _late(self) -> bool:
        """Whether ``every_minutes`` passed since the last save on any rank (a collective when distributed)."""
        local = self.clock() - self.last_save >= self.seconds
        if not (dist.is_available() and dist.is_initialized()):
            return local
        flag = torch.tensor([int(local)], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def due(self, step: int) -> bool:
        """Whether to save after ``step``; a yes restarts the wall clock (the caller saves)."""
        if not self.enabled:
            return False
        by_steps = step % self.every == 0 or step == self.total_steps
        by_time = self.seconds > 0 and self._late()  # always evaluated: every rank joins the all-reduce
        if by_steps or by_time:
            self.last_save = self.clock()
        return by_steps or by_time
