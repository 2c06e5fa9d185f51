"""Downstream tasks inside the training loop: ``[eval]`` names the tasks and the cadence.

The trainer builds one :class:`DownstreamEval` over its live model; every ``eval.every`` steps (and at the
last step) it scores the tasks with lm-eval-harness through :class:`~tessera.evaluate.harness.TesseraLM`,
the documents dealt over the data-parallel ranks, and logs ``eval/<task>/<metric>`` with the step's record.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from tessera.config import JobConfig, eval_task_names
from tessera.evaluate.scoring import Reduce, Scorer


def resolve_task_dirs(config: JobConfig, cache_root: Path) -> list[Path]:
    """The task directories of ``[eval]`` (the built-in stdlib tasks built into the cache on first use)."""
    from tessera.evaluate.tasks import task_dirs_for

    extra = [d.strip() for d in config.eval.task_dirs.split(",") if d.strip()]
    return task_dirs_for(eval_task_names(config.eval), extra, cache_root, config.eval.stdlib_docs)


def check_eval(config: JobConfig, cache_root: Path) -> None:
    """Before anything starts: lm-eval installed, every task known, every local row well formed."""
    if not eval_task_names(config.eval):
        return
    from tessera.evaluate.harness import require_lm_eval
    from tessera.evaluate.tasks import check_tasks

    require_lm_eval()
    check_tasks(eval_task_names(config.eval), resolve_task_dirs(config, cache_root))


class DownstreamEval:
    """The ``[eval]`` tasks of one job, scored on the live model of this rank."""

    def __init__(
        self,
        config: JobConfig,
        model: nn.Module,
        tokenizer,
        device: torch.device,
        dp: tuple[int, int, Reduce],
        cache_root: Path,
        autocast: Callable | None = None,
    ) -> None:
        from tessera.evaluate.tasks import check_tasks

        self.config = config.eval
        self.total_steps = config.train.steps
        self.tasks = eval_task_names(config.eval)
        self.task_dirs = resolve_task_dirs(config, cache_root)
        self.local_only = check_tasks(self.tasks, self.task_dirs)
        rank, size, reduce = dp
        max_len = config.model.max_seq_len
        self.scorer = Scorer(model, device, max_len, rank, size, reduce, autocast)
        self.tokenizer = tokenizer

    def due(self, step: int) -> bool:
        """Whether the tasks are scored after ``step`` (every ``eval.every`` steps and at the last)."""
        every = self.config.every
        return step == self.total_steps or (every > 0 and step % every == 0)

    def run(self) -> dict[str, float]:
        """``{"eval/<task>/<metric>": value}`` for every task (equal on every rank)."""
        from tessera.evaluate.harness import TesseraLM, run_tasks

        lm = TesseraLM(scorer=self.scorer, tokenizer=self.tokenizer)
        scores = run_tasks(lm, self.tasks, self.task_dirs, self.config.limit, include_defaults=not self.local_only)
        return {f"eval/{k}": v for k, v in scores.items()}
