"""Mixture of experts: a router (switch top-1 or top-k), capacity, aux/z losses, a batched expert bank.

Experts are stored as batched weights ``gate_proj``/``up_proj`` (E, dim, hidden) and ``down_proj``
(E, hidden, dim), so expert parallelism can shard dimension 0. A layer keeps nothing between
forwards: when the caller passes a :class:`MoELog` (which the model threads down to every MoE
layer), each layer records its :class:`RouterStats` there (the weighted auxiliary loss to add to
the training loss, and detached statistics to log); see :func:`moe_loss` and :func:`moe_metrics`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tessera.config import ModelConfig
from tessera.model.ffn import ACTIVATIONS, GATED, FeedForward, ffn_hidden_size


@dataclass
class RouterStats:
    """One MoE layer's routing in one forward; tensors, so reading them is the caller's (one) sync."""

    loss: torch.Tensor  # aux_loss_coef * aux_loss + z_loss_coef * z_loss, differentiable
    aux_loss: torch.Tensor  # load-balancing loss (detached)
    z_loss: torch.Tensor  # router z-loss (detached)
    load: torch.Tensor  # (E,) fraction of routed assignments per expert
    dropped: torch.Tensor  # fraction of assignments dropped by the capacity limit


class MoELog:
    """What one forward's MoE layers record: their :class:`RouterStats`, in forward order.

    The caller creates one per forward and passes it down (``model(x, moe_log=log)``); a plain
    object rather than a dict, so wrappers that rebuild containers in the inputs (FSDP, DDP) hand
    the layers this very object. A recompute under activation checkpointing overwrites its
    layer's entry with the same numbers.
    """

    def __init__(self) -> None:
        self.layers: dict[nn.Module, RouterStats] = {}

    def record(self, layer: nn.Module, stats: RouterStats) -> None:
        """Keep ``layer``'s stats of this forward."""
        self.layers[layer] = stats

    def __len__(self) -> int:
        return len(self.layers)


def is_moe_layer(cfg: ModelConfig, layer_id: int) -> bool:
    """Whether layer ``layer_id`` uses MoE (every ``moe_every``-th layer when experts are set)."""
    return cfg.moe.experts > 0 and (layer_id + 1) % cfg.moe.every == 0


class Experts(nn.Module):
    """E feed-forward networks as batched weight tensors."""

    def __init__(self, n_experts: int, dim: int, hidden: int, activation: str) -> None:
        super().__init__()
        self.act = ACTIVATIONS[activation]
        self.gated = activation in GATED
        self.gate_proj = nn.Parameter(torch.empty(n_experts, dim, hidden)) if self.gated else None
        self.up_proj = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.down_proj = nn.Parameter(torch.empty(n_experts, hidden, dim))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` applied to tokens ``x`` (N, dim)."""
        h = self.act(x @ self.gate_proj[e]) * (x @ self.up_proj[e]) if self.gated else self.act(x @ self.up_proj[e])
        return h @ self.down_proj[e]


class MoE(nn.Module):
    """Routed experts (plus optional always-on shared experts) replacing a block's FFN."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        self.n_experts, self.top_k = moe.experts, moe.top_k
        self.router_order, self.capacity_factor = moe.router, moe.capacity_factor
        self.aux_coef, self.z_coef = moe.aux_loss_coef, moe.z_loss_coef
        hidden = moe.ffn_hidden or ffn_hidden_size(
            cfg.dim, cfg.activation, cfg.ffn_hidden, cfg.ffn_multiplier, cfg.multiple_of
        )
        self.router = nn.Linear(cfg.dim, moe.experts, bias=False)
        self.experts = Experts(moe.experts, cfg.dim, hidden, cfg.activation)
        self.shared = FeedForward(cfg.dim, hidden * moe.shared_experts, cfg.activation) if moe.shared_experts else None

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Top-k weights (N, k), expert ids (N, k) and the full softmax (N, E) of router logits."""
        probs = logits.softmax(dim=-1)
        if self.router_order == "softmax_topk":
            weights, ids = probs.topk(self.top_k, dim=-1)
        else:
            top, ids = logits.topk(self.top_k, dim=-1)
            weights = top.softmax(dim=-1)
        return weights, ids, probs

    def _keep(self, ids: torch.Tensor) -> torch.Tensor:
        """(N, k) bool: assignments within expert capacity; first choices go first, then token order."""
        if self.capacity_factor <= 0:
            return torch.ones_like(ids, dtype=torch.bool)
        n = ids.shape[0]
        capacity = math.ceil(self.capacity_factor * n * self.top_k / self.n_experts)
        order = ids.T.reshape(-1)  # choice-major priority
        onehot = F.one_hot(order, self.n_experts)
        slot = (onehot.cumsum(0) * onehot).sum(-1) - 1
        return (slot < capacity).view(self.top_k, n).T

    def forward(self, x: torch.Tensor, log: MoELog | None = None) -> torch.Tensor:
        """Route each token of ``x`` (B, T, dim) to its experts and mix their outputs; record into ``log``."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.router(x).float()
        weights, ids, probs = self.route(logits)
        keep = self._keep(ids)
        out = torch.zeros_like(x)
        for e in range(self.n_experts):
            token, choice = torch.where((ids == e) & keep)
            if token.numel():
                y = self.experts.expert(e, x[token]) * weights[token, choice, None].to(x.dtype)
                out = out.index_add(0, token, y)
        if self.shared is not None:
            out = out + self.shared(x)
        if log is not None:
            log.record(self, self.stats(logits, probs, ids, keep))
        return out.view(shape)

    def stats(self, logits: torch.Tensor, probs: torch.Tensor, ids: torch.Tensor, keep: torch.Tensor) -> RouterStats:
        """Load-balancing loss (Switch/Mixtral: E * sum_e assigned_e / N * mean prob_e), z-loss, load."""
        counts = F.one_hot(ids, self.n_experts).sum(dim=(0, 1)).float()
        aux = self.n_experts * (counts / ids.shape[0] * probs.mean(0)).sum()
        z = torch.logsumexp(logits, dim=-1).pow(2).mean()
        loss = self.aux_coef * aux + self.z_coef * z
        dropped = 1.0 - keep.float().mean()
        return RouterStats(loss, aux.detach(), z.detach(), (counts / counts.sum()).detach(), dropped.detach())


def moe_loss(log: MoELog) -> torch.Tensor | None:
    """The summed weighted auxiliary losses of one forward's MoE layers (None without MoE)."""
    if not log.layers:
        return None
    return sum(stats.loss for stats in log.layers.values())


def moe_metrics(logs: list[MoELog]) -> dict[str, torch.Tensor]:
    """Aux loss, z loss, dropped fraction and imbalance (max / mean expert load), averaged over the
    layers and forwards of ``logs``; tensors, so the caller reads them once per logged step."""
    stats = [s for log in logs for s in log.layers.values()]
    if not stats:
        return {}
    n = len(stats)
    return {
        "moe_aux_loss": sum(s.aux_loss for s in stats) / n,
        "moe_z_loss": sum(s.z_loss for s in stats) / n,
        "moe_dropped": sum(s.dropped for s in stats) / n,
        "moe_load_max": sum(s.load.max() * s.load.numel() for s in stats) / n,
    }


def expert_load(log: MoELog) -> list[torch.Tensor]:
    """Per-layer fraction of routed assignments that went to each expert (E,), in forward order."""
    return [s.load for s in log.layers.values()]
