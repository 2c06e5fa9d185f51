"""One micro-batch and its loss: the terms of the training objective added up in one place.

The trainer (plain torch and DeepSpeed steps) and a pipeline's last stage both call
:func:`combine_losses`: the token loss times its weight (context parallelism: this rank's share
of the global token mean; in a pipeline also the micro-batch's share of the local batch), the
multi-token-prediction depths at ``mtp_loss_weight / depth`` each, and the MoE losses. How much a
micro-batch's MoE losses weigh in the optimizer step is :func:`moe_aux_weight` for both: a pp=1
step adds them at weight 1 and divides the micro-batch's loss by ``grad_accum``; a pipeline
attaches them per schedule micro-batch.

A leaf below ``train/`` (``parallel/`` never imports ``train/``), so both may import it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor


@dataclass
class MicroBatch:
    """One micro-batch as the objective makes it: the model's positional and keyword inputs, its labels
    and (masked LM, span corruption, document packing) the mask of the positions that get a loss."""

    args: tuple[torch.Tensor, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    labels: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None

    @classmethod
    def of(cls, parts: tuple[Any, ...]) -> MicroBatch:
        """From an objective's ``(args, kwargs, labels, loss_mask)``."""
        args, kwargs, labels, loss_mask = parts
        return cls(tuple(args), dict(kwargs), labels, loss_mask)

    def to(self, device: torch.device) -> MicroBatch:
        """This micro-batch on ``device`` (copies started without waiting)."""
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        kwargs = {k: move(v) for k, v in self.kwargs.items()}
        return MicroBatch(tuple(map(move, self.args)), kwargs, move(self.labels), move(self.loss_mask))

    def tokens(self) -> int | torch.Tensor:
        """The positions that get a loss: every label, or the loss mask's count (a tensor: no host sync)."""
        return self.labels.numel() if self.loss_mask is None else self.loss_mask.sum()


@dataclass(frozen=True)
class LossWeights:
    """How one micro-batch's terms add up to its loss."""

    main: float | torch.Tensor = 1.0  # the mean token loss's factor (cp share; pipeline: x tokens / local batch)
    mtp_weight: float = 0.0  # train.mtp_loss_weight, shared evenly by the depths


def combine_losses(
    main: torch.Tensor,
    weights: LossWeights,
    mtp: list[torch.Tensor] | tuple[torch.Tensor, ...] = (),
    aux: torch.Tensor | None = None,
    distill: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The micro-batch's loss: ``main * weights.main``, then ``distill`` of it (the trainer's distillation),
    plus ``mtp_weight / D`` times the sum of the ``D`` depths' losses ``mtp`` (each already weighted as the
    caller counts it), plus the MoE losses ``aux``. The main loss may be a replicated DTensor (loss
    parallelism) beside plain other terms, or plain beside a DTensor MTP term (the fused head)."""
    loss = main if isinstance(weights.main, float) and weights.main == 1.0 else main * weights.main
    if distill is not None:
        loss = distill(loss)
    if mtp:
        extra = sum(mtp) * (weights.mtp_weight / len(mtp))
        if isinstance(extra, DTensor) and not isinstance(loss, DTensor):
            extra = extra.full_tensor()
        loss = loss + extra
    return loss if aux is None else add_replicated(loss, aux)


def moe_aux_weight(grad_accum: int, microbatches: int = 1) -> float:
    """A micro-batch's MoE losses' weight in the optimizer step's loss: one over the forwards it takes."""
    return 1.0 / (grad_accum * microbatches)


def add_replicated(loss: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    """``loss + extra`` where ``loss`` may be a replicated DTensor (loss parallelism) and ``extra`` is not."""
    if isinstance(loss, DTensor) and not isinstance(extra, DTensor):
        extra = DTensor.from_local(extra, loss.device_mesh, loss.placements, run_check=False)
    return loss + extra
