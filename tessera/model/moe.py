"""Mixture of experts: a router (switch top-1 or top-k), capacity, aux/z losses, a batched expert bank.

Experts are stored as batched weights ``gate_proj``/``up_proj`` (E, dim, hidden) and ``down_proj``
(E, hidden, dim), so expert parallelism can shard dimension 0. After each forward a layer keeps
its load-balancing loss, router z-loss and per-expert load for the trainer (see ``moe_losses`` and
``moe_metrics``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tessera.config import ModelConfig
from tessera.model.ffn import ACTIVATIONS, GATED, FeedForward, ffn_hidden_size


def is_moe_layer(cfg: ModelConfig, layer_id: int) -> bool:
    """Whether layer ``layer_id`` uses MoE (every ``moe_every``-th layer when experts are set)."""
    return cfg.moe_experts > 0 and (layer_id + 1) % cfg.moe_every == 0


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
        self.n_experts, self.top_k = cfg.moe_experts, cfg.moe_top_k
        self.router_order, self.capacity_factor = cfg.moe_router, cfg.moe_capacity_factor
        self.aux_coef, self.z_coef = cfg.moe_aux_loss_coef, cfg.moe_z_loss_coef
        hidden = cfg.moe_ffn_hidden or ffn_hidden_size(cfg.dim, cfg.activation, cfg.ffn_hidden, cfg.ffn_multiplier, cfg.multiple_of)
        self.router = nn.Linear(cfg.dim, cfg.moe_experts, bias=False)
        self.experts = Experts(cfg.moe_experts, cfg.dim, hidden, cfg.activation)
        self.shared = FeedForward(cfg.dim, hidden * cfg.moe_shared_experts, cfg.activation) if cfg.moe_shared_experts else None
        self.aux_loss = torch.zeros(())
        self.z_loss = torch.zeros(())
        self.load = torch.zeros(cfg.moe_experts)
        self.dropped = 0.0

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Route each token of ``x`` (B, T, dim) to its experts and mix their outputs."""
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
        self._record(logits, probs, ids, keep)
        return out.view(shape)

    def _record(self, logits: torch.Tensor, probs: torch.Tensor, ids: torch.Tensor, keep: torch.Tensor) -> None:
        counts = F.one_hot(ids, self.n_experts).sum(dim=(0, 1)).float()
        n = ids.shape[0]
        # Switch/Mixtral load balancing: E * sum_e (assignments_e / N) * mean router prob_e.
        self.aux_loss = self.n_experts * (counts / n * probs.mean(0)).sum()
        self.z_loss = torch.logsumexp(logits, dim=-1).pow(2).mean()
        self.load = (counts / counts.sum()).detach()
        self.dropped = float(1.0 - keep.float().mean())


def moe_layers(model: nn.Module) -> list[MoE]:
    """Every MoE layer of ``model`` in module order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def moe_losses(model: nn.Module) -> torch.Tensor | None:
    """Weighted sum of the last forward's aux and z losses over all MoE layers (None without MoE)."""
    layers = moe_layers(model)
    if not layers:
        return None
    return sum(m.aux_coef * m.aux_loss + m.z_coef * m.z_loss for m in layers)


def moe_metrics(model: nn.Module) -> dict[str, float]:
    """Aux loss, z loss, dropped fraction and load imbalance (max / mean expert load), averaged over layers."""
    layers = moe_layers(model)
    if not layers:
        return {}
    n = len(layers)
    return {
        "moe_aux_loss": sum(float(m.aux_loss.detach()) for m in layers) / n,
        "moe_z_loss": sum(float(m.z_loss.detach()) for m in layers) / n,
        "moe_dropped": sum(m.dropped for m in layers) / n,
        "moe_load_max": sum(float(m.load.max() * m.n_experts) for m in layers) / n,
    }


def expert_load(model: nn.Module) -> list[torch.Tensor]:
    """Per-layer fraction of routed assignments that went to each expert (E,), from the last forward."""
    return [m.load for m in moe_layers(model)]
