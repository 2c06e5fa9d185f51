"""A training batch: packed token windows plus the document-aware tensors the model and loss read.

Documents are packed back to back and each ends in EOD. With ``document_mask`` every token gets
the id of its document (the EOD closing a document belongs to it) and a position that restarts
at 0 after every EOD, so attention can be blocked across documents. With ``mask_eod_loss`` the
positions whose input token is EOD get no loss (the prediction that would cross into the next
document), as Megatron's ``--eod-mask-loss`` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Batch:
    """``tokens`` (B, T+1); ``positions``/``document_ids``/``loss_mask`` (B, T) when enabled, else None."""

    tokens: torch.Tensor
    positions: torch.Tensor | None = None
    document_ids: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> Batch:
        """The batch on ``device``."""
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return Batch(move(self.tokens), move(self.positions), move(self.document_ids), move(self.loss_mask))

    def model_kwargs(self) -> dict[str, torch.Tensor]:
        """Keyword arguments for ``model(inputs, **kwargs)``: positions and document ids when set."""
        if self.document_ids is None:
            return {}
        return {"positions": self.positions, "document_ids": self.document_ids}


def document_tensors(inputs: torch.Tensor, eod: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Document ids and within-document positions of (B, T) input tokens; documents end at ``eod``."""
    is_eod = (inputs == eod).long()
    document_ids = torch.cumsum(is_eod, dim=1) - is_eod
    steps = torch.arange(inputs.shape[1]).expand_as(inputs)
    starts = torch.zeros_like(inputs)
    starts[:, 1:] = torch.where(is_eod[:, :-1].bool(), steps[:, 1:], 0)
    positions = steps - torch.cummax(starts, dim=1).values
    return positions, document_ids


@dataclass(frozen=True)
class Collate:
    """Stacks windows into a :class:`Batch`, adding the document tensors the options ask for."""

    eod: int
    document_mask: bool = False
    mask_eod_loss: bool = False

    def __call__(self, windows: Sequence[np.ndarray]) -> Batch:
        tokens = torch.from_numpy(np.stack(windows).astype(np.int64, copy=False))
        batch = Batch(tokens)
        inputs = tokens[:, :-1]
        if self.document_mask:
            batch.positions, batch.document_ids = document_tensors(inputs, self.eod)
        if self.mask_eod_loss:
            batch.loss_mask = inputs != self.eod
        return batch
