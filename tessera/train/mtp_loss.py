"""The multi-token-prediction term of the training loss (``model.mtp_depth``, ``train.mtp_loss_weight``).

The model records each depth's logits in an :class:`~tessera.model.mtp.MTPLog` passed to its
forward; :func:`~tessera.parallel.loss.combine_losses` adds ``mtp_loss_weight / D * sum_k loss_k`` to
the step's loss (DeepSeek-V3's weighting) and this term keeps each depth's loss for the log
(``mtp_loss_1`` .. ``mtp_loss_D``).
"""

from __future__ import annotations

from typing import Any

import torch

from tessera.model.mtp import LossFn, MTPLog, mtp_ahead, mtp_losses
from tessera.train.distributed import scalar

MTP_AHEAD_KEYS = ("mtp_tokens", "mtp_labels", "mtp_mask")  # the batch entries :func:`with_mtp_ahead` adds


def with_mtp_ahead(parts: tuple[Any, ...], depth: int) -> tuple[Any, ...]:
    """An objective's ``(args, kwargs, labels, loss_mask)`` with each MTP depth's inputs and targets over the
    whole sequences added to ``kwargs`` (context parallelism cuts them with the rest: a rank's last positions
    read tokens that another rank holds)."""
    args, kwargs, labels, loss_mask = parts
    return args, {**kwargs, **mtp_ahead(args[0], labels, loss_mask, depth)}, labels, loss_mask


class MTPLoss:
    """Adds the weighted MTP losses to each micro-batch's loss; reports per-depth means per step."""

    def __init__(self, depth: int, weight: float, loss_fn: LossFn, label_smoothing: float = 0.0) -> None:
        self.depth, self.weight, self.loss_fn, self.label_smoothing = depth, weight, loss_fn, label_smoothing
        self._log = MTPLog()
        self._sums, self._count = [0.0] * depth, 0

    def forward_kwargs(self, ahead: torch.Tensor | None = None) -> dict[str, Any]:
        """What the model's forward needs: a fresh log for this micro-batch's MTP logits (with ``ahead``, the
        tokens each depth reads, made before a context-parallel split: see :func:`with_mtp_ahead`)."""
        self._log = MTPLog(ahead=ahead)
        return {"mtp": self._log}

    def depth_losses(
        self,
        labels: torch.Tensor,
        loss_mask: torch.Tensor | None,
        targets: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> list[torch.Tensor]:
        """This micro-batch's mean loss at each depth (recorded for the log); :func:`combine_losses` weighs them.
        ``targets``: each depth's (labels, mask) made before a context-parallel split, else rolled from ``labels``."""
        if targets is None:
            losses = mtp_losses(self._log.logits, labels, loss_mask, self.loss_fn, self.label_smoothing)
        else:
            pairs = zip(self._log.logits, targets)
            losses = [self.loss_fn(lg, t, self.label_smoothing, m) for lg, (t, m) in pairs]
        self._log = MTPLog()  # release the logits once the graph holds what backward needs
        for k, depth_loss in enumerate(losses):
            self._sums[k] += scalar(depth_loss)
        self._count += 1
        return losses

    def metrics(self) -> dict[str, float]:
        """Each depth's mean loss over the micro-batches since the last call (``mtp_loss_1`` ...)."""
        out = {f"mtp_loss_{k + 1}": s / max(self._count, 1) for k, s in enumerate(self._sums)}
        self._sums, self._count = [0.0] * self.depth, 0
        return out
