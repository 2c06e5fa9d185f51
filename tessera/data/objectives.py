"""Training objectives as functions of a packed token batch."""

from __future__ import annotations

import torch


def causal_lm(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token labels from (batch, seq_len + 1) tokens."""
    return batch[:, :-1], batch[:, 1:]
