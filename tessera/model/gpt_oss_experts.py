"""gpt-oss's experts: biases on every expert projection and the clamped SwiGLU.

``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = clamp(gate, max=limit)``
(OpenAI gpt-oss, alpha 1.702, limit 7): the same (E, dim, hidden) batched weights as
:class:`~tessera.model.moe.Experts` plus ``gate_bias``/``up_bias`` (E, hidden) and ``down_bias``
(E, dim). Rows run expert by expert (the loop path; biases ride along), also under expert parallelism.
Its router (a biased linear, softmax over the top-k logits) is ``model.moe.router_bias`` with ``topk_softmax``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tessera import registry
from tessera.config.checks import require

SWIGLU_ALPHA = 1.702  # gpt-oss's sigmoid slope (HF GptOssExperts.alpha)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """gpt-oss's gated unit; ``limit`` <= 0 leaves both inputs unclamped."""
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(gate * SWIGLU_ALPHA)


class BiasedExperts(nn.Module):
    """E gated experts with a bias on each projection; the clamped SwiGLU when ``limit`` > 0, else SwiGLU.

    The interface of :class:`~tessera.model.moe.Experts`; expert parallelism shards all six :data:`BANKS`
    and runs :func:`biased_expert_ffn` on its local experts."""

    def __init__(self, n_experts: int, dim: int, hidden: int, limit: float, std: float, out_std: float) -> None:
        super().__init__()
        self.limit, self.std, self.out_std = limit, std, out_std
        self.gated = True
        self.gate_proj = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.up_proj = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.down_proj = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.gate_bias = nn.Parameter(torch.empty(n_experts, hidden))
        self.up_bias = nn.Parameter(torch.empty(n_experts, hidden))
        self.down_bias = nn.Parameter(torch.empty(n_experts, dim))

    def reset_parameters(self) -> None:
        """Weights normal(0, init_std) (down_proj scaled like every residual output); biases zero."""
        for p in (self.gate_proj, self.up_proj):
            nn.init.normal_(p, std=self.std)
        nn.init.normal_(self.down_proj, std=self.out_std)
        for p in (self.gate_bias, self.up_bias, self.down_bias):
            nn.init.zeros_(p)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` applied to tokens ``x`` (N, dim)."""
        banks = [getattr(self, name)[e : e + 1] for name in BANKS]
        return biased_expert_ffn(x, [x.shape[0]], banks, self.limit)

    def forward(self, x: torch.Tensor, counts: torch.Tensor, padded: bool = True) -> torch.Tensor:
        """Rows ``x`` (M, dim) sorted by expert, ``counts`` (E,) rows per expert -> outputs (M, dim); rows past
        ``counts.sum()`` (dropped assignments) come back as zeros. Every expert's weights join the graph."""
        banks = [getattr(self, name) for name in BANKS]
        return biased_expert_ffn(x, counts.tolist(), banks, self.limit)


BANKS = ("gate_proj", "up_proj", "down_proj", "gate_bias", "up_bias", "down_bias")  # what expert parallelism shards


def biased_expert_ffn(x: torch.Tensor, sizes: list[int], banks: list[torch.Tensor], limit: float) -> torch.Tensor:
    """Rows ``x`` grouped by expert (``sizes[e]`` rows each) through the :data:`BANKS` (gate, up, down and their
    biases, one row per expert); rows past ``sum(sizes)`` come back as zeros (also expert parallelism's path)."""
    parts = x[: sum(sizes)].split(sizes)
    gates, ups, downs, gate_b, up_b, down_b = (bank.unbind(0) for bank in banks)
    outs = []
    for part, g, u, d, gb, ub, db in zip(parts, gates, ups, downs, gate_b, up_b, down_b, strict=True):
        gate, up = part @ g + gb, part @ u + ub
        h = clamped_swiglu(gate, up, limit) if limit > 0 else F.silu(gate) * up
        outs.append(h @ d + db)
    y = torch.cat(outs) if outs else x[:0]
    return F.pad(y, (0, 0, 0, x.shape[0] - y.shape[0]))


def gpt_oss_experts(cfg: Any, hidden: int) -> BiasedExperts | None:
    """gpt-oss's biased, clamped experts when ``cfg`` asks for them (``model.moe.expert_biases`` or
    ``swiglu_limit``), else None (the plain bank)."""
    moe = cfg.moe
    if not (moe.expert_biases or moe.swiglu_limit > 0):
        return None
    out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    return BiasedExperts(moe.experts, cfg.dim, hidden, moe.swiglu_limit, cfg.init_std, out_std)


def check_gpt_oss_experts(m: Any) -> None:
    """gpt-oss's experts are SwiGLU experts."""
    require(
        m.activation == "swiglu",
        f"model.moe.expert_biases / model.moe.swiglu_limit are gpt-oss's SwiGLU experts; model.activation="
        f"'{m.activation}' would be ignored: set model.activation='swiglu'",
    )


SPEC = registry.option(
    name="gpt_oss_experts",
    feature="gpt-oss experts (expert biases, clamped SwiGLU)",
    keys=("model.moe.expert_biases", "model.moe.swiglu_limit"),
    uses=lambda m: m.moe.experts > 1 and (m.moe.expert_biases or m.moe.swiglu_limit > 0),
    unsupported={
        "deepspeed": "not validated with the DeepSpeed engine yet; use parallel.engine='torch'",
    },
    checks=(check_gpt_oss_experts,),
)
