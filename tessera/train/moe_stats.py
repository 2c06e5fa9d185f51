"""Expert load over every process of a run: step metrics, the aux-free bias update, an end-of-run report.

Each MoE layer records its routed and dropped assignments per expert (:class:`RouterStats`); a
step's counts are summed over its micro-batches and then over all processes (one all-reduce of a
``(layers, 2, experts)`` tensor), so the logged load covers the tokens of every data-parallel and
expert-parallel rank and, under pipeline parallelism, every stage's layers. Tensor-parallel ranks
count the same tokens, which scales every count alike and leaves the fractions exact. The logged aux
and z losses ride in the same all-reduce: their mean over every process's layer forwards (under
context parallelism the mean over the cp ranks is the whole sequences' loss).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tessera.config import ModelConfig
from tessera.model import MoELog, build_model, moe_metrics
from tessera.model.moe import (
    expert_counts,
    expert_load_report,
    moe_layer_names,
    update_expert_bias,
)


def _loss_sums(logs: list[MoELog], device: torch.device) -> torch.Tensor:
    """(aux loss sum, z loss sum, layer forwards) of this process's MoE layers in ``logs``."""
    metrics, n = moe_metrics(logs), sum(len(log) for log in logs)
    if not metrics:
        return torch.zeros(3, device=device)
    return torch.stack([metrics["moe_aux_loss"] * n, metrics["moe_z_loss"] * n, torch.tensor(float(n), device=device)])


def _sum_over_processes(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(t)
    return t


class ExpertLoadTracker:
    """Per-expert load of every MoE layer of one run (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, model: nn.Module, device: torch.device, replicas: int = 1) -> None:
        with torch.device("meta"):
            self.order = list(moe_layer_names(build_model(cfg)).values())  # every MoE layer, stages included
        self.names = moe_layer_names(model)  # this process's layers
        self.n_experts, self.rate, self.device = cfg.moe.experts, cfg.moe.bias_update_rate, device
        self.replicas = replicas  # processes that see the same tokens (tensor-parallel ranks)
        self.totals = torch.zeros(len(self.order), 2, self.n_experts, device=device)

    @classmethod
    def for_model(
        cls, cfg: ModelConfig, model: nn.Module, device: torch.device, replicas: int = 1
    ) -> ExpertLoadTracker | None:
        """A tracker when the model has MoE layers, else None."""
        return cls(cfg, model, device, replicas) if cfg.moe.experts else None

    def step(self, logs: list[MoELog]) -> dict[str, Any]:
        """One optimizer step's MoE metrics over every process (load, dropped fraction, imbalance, and the
        aux and z losses averaged over every layer forward of every process); moves the aux-free
        balancing biases. Every process must call it (a collective)."""
        counts = expert_counts(logs, self.names, self.order, self.n_experts, self.device)
        self.totals += counts
        losses = _loss_sums(logs, self.device)
        summed = _sum_over_processes(torch.cat([counts.flatten(), losses]))  # one all-reduce
        counts, losses = summed[: counts.numel()].view_as(counts), summed[counts.numel() :]
        if self.rate > 0:
            update_expert_bias(self.names, self.order, counts, self.rate)
        routed, dropped = counts[:, 0], counts[:, 1]
        load = routed / routed.sum(-1, keepdim=True).clamp(min=1.0)
        summary = torch.stack(
            [dropped.sum() / routed.sum().clamp(min=1.0), load.max(-1).values.mean() * self.n_experts]
        )
        # Under context parallelism a rank's losses are its share times cp: their mean is the sequences' loss.
        mean_losses = losses[:2] / losses[2].clamp(min=1.0)
        values = torch.cat([summary, mean_losses]).tolist()
        metrics = dict(zip(["moe_dropped", "moe_imbalance", "moe_aux_loss", "moe_z_loss"], values))
        metrics["moe_expert_load"] = [[round(x, 5) for x in row] for row in load.tolist()]
        return metrics

    def finish(self, run_dir: Path, write: bool) -> str:
        """The run's expert load per layer (all processes): writes ``expert_load.json`` when ``write``
        and returns the report. Every process must call it (a collective)."""
        totals = _sum_over_processes(self.totals.clone()) / self.replicas
        if write:
            layers = [
                {"layer": name, "assignments": routed, "dropped": dropped}
                for name, (routed, dropped) in zip(self.order, totals.tolist())
            ]
            (Path(run_dir) / "expert_load.json").write_text(json.dumps({"layers": layers}, indent=1))
        return "expert load per MoE layer (whole run, all ranks):\n" + expert_load_report(self.order, totals)
