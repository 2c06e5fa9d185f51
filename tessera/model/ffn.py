"""Feed-forward networks: gated (SwiGLU, GeGLU) and plain (GELU, ReLU)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {
    "swiglu": F.silu,
    "geglu": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
GATED = ("swiglu", "geglu")


def ffn_hidden_size(dim: int, activation: str, hidden: int = 0, multiplier: float = 0.0, multiple_of: int = 1) -> int:
    """Hidden width: ``hidden`` if set, else dim x multiplier (4, or 8/3 when gated) rounded up."""
    if hidden:
        return hidden
    if not multiplier:
        multiplier = 8 / 3 if activation in GATED else 4.0
    return multiple_of * math.ceil(int(dim * multiplier) / multiple_of)


class FeedForward(nn.Module):
    """down(act(gate(x)) * up(x)) when gated, else down(act(up(x)))."""

    def __init__(self, dim: int, hidden: int, activation: str, bias: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}")
        self.act = ACTIVATIONS[activation]
        self.gated = activation in GATED
        self.gate_proj = nn.Linear(dim, hidden, bias=bias) if self.gated else None
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.gate_proj(x)) * self.up_proj(x) if self.gated else self.act(self.up_proj(x))
        return self.down_proj(self.dropout(h))
