"""Feed-forward networks: gated (SwiGLU, GeGLU) and plain (GELU, ReLU, squared ReLU)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tessera import registry
from tessera.dtypes import autocast_input

ACTIVATIONS = {
    "swiglu": F.silu,
    "geglu": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),  # squared ReLU (So et al. 2021; Nemotron-H's FFN)
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

    def __init__(
        self,
        dim: int,
        hidden: int,
        activation: str,
        bias: bool = False,
        dropout: float = 0.0,
        multipliers: tuple[float, float] = (1.0, 1.0),
    ) -> None:
        super().__init__()
        # muP factors (model.mup.ffn_gate, ffn_down; Falcon-H1): the gate before its activation, the output.
        self.gate_multiplier, self.down_multiplier = multipliers
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}")
        self.act = ACTIVATIONS[activation]
        self.gated = activation in GATED
        self.gate_proj = nn.Linear(dim, hidden, bias=bias) if self.gated else None
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            x = autocast_input(x)  # read by two projections: cast once
            gate = self.gate_proj(x)
            h = self.act(gate * self.gate_multiplier if self.gate_multiplier != 1.0 else gate) * self.up_proj(x)
        else:
            h = self.act(self.up_proj(x))
        out = self.down_proj(self.dropout(h))
        return out * self.down_multiplier if self.down_multiplier != 1.0 else out


def hidden_bytes(hidden: int, gated: bool, compute: int) -> float:
    """Saved bytes per token inside a FFN: gated: gate output, activation output, up output, their product;
    plain: up output, activation output."""
    return (4.0 if gated else 2.0) * compute * hidden


def dense_memory(shape: Any, block: Any, prec: Any) -> tuple[float, float, float, float]:
    """The planner's term (plan/activations.py): (gathered, sharded, op gathered, op sharded) saved bytes per
    token of a dense FFN sublayer; ``shape`` a plan ModelShape, ``prec`` a plan Precision."""
    h, c = shape.dim, prec.compute
    dropout = shape.ffn_hidden if shape.cfg.dropout > 0 else 0.0
    gathered = c * h  # its input (gate and up share one cast copy under autocast: tessera.dtypes.autocast_input)
    sharded = hidden_bytes(shape.ffn_hidden, shape.gated, c) + dropout
    return gathered, sharded, c * h, (2 if shape.gated else 1) * c * shape.ffn_hidden


FFN_TP = {"up_proj": "colwise", "down_proj": "rowwise", "gate_proj": "colwise"}

DENSE = registry.register(
    registry.Spec(
        kind="ffn",
        name="dense",
        feature="dense FFN (ReLU, squared ReLU, GELU, SwiGLU, GeGLU)",
        keys=("model.activation", "model.ffn_hidden", "model.ffn_multiplier", "model.multiple_of", "model.ffn_bias"),
        uses=lambda m: m.moe.experts <= 1 or m.moe.first_dense > 0 or m.moe.every > 1,
        unsupported={},
        checks=(),
        terms=registry.Terms(flops=registry.zero, memory=dense_memory),  # its matmuls are in 6 * N
        tp_plan=FFN_TP,
    )
)
