"""AdamW with decay/no-decay parameter groups and warmup + decay learning-rate schedules."""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn

from tessera.config import OptimConfig


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only: norms, biases and embedding tables get none."""
    embedding_params = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    decay, no_decay, seen = [], [], set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (no_decay if p.ndim < 2 or id(p) in embedding_params else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """The optimizer named by ``optim.name`` over :func:`parameter_groups`."""
    return torch.optim.AdamW(
        parameter_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
    )


def lr_multiplier(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Factor on ``optim.lr`` before optimizer step ``step`` (0-based).

    Linear warmup to 1, then cosine or linear decay to ``min_lr_ratio``, constant, or
    warmup-stable-decay (flat, then linear decay over the last ``decay_fraction`` of steps).
    """
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    floor = cfg.min_lr_ratio
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "wsd":
        decay_start = max(cfg.warmup_steps, int(total_steps * (1 - cfg.decay_fraction)))
        if step < decay_start:
            return 1.0
        progress = (step - decay_start) / max(1, total_steps - decay_start)
        return 1.0 - (1.0 - floor) * min(1.0, progress)
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    if cfg.schedule == "linear":
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over :func:`lr_multiplier`; its state_dict is plain numbers."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_multiplier, cfg=cfg, total_steps=total_steps))


def keep_config_hyperparameters(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, fresh_groups: list[dict]
) -> None:
    """After loading a checkpoint, put back the hyper-parameters the config gave (``fresh_groups``).

    The checkpoint's parameter groups and schedule state carry the lr, betas, eps and weight decay
    it was trained with; a resumed run uses the config's instead (and continues the schedule at the
    saved step). Unchanged values give the same floats, so an unchanged resume stays bitwise exact.
    """
    for group, fresh in zip(optimizer.param_groups, fresh_groups):
        group.update({k: v for k, v in fresh.items() if k not in ("params", "lr")})
    scheduler.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
    lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs
