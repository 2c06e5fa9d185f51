"""The optimizer (AdamW, or Muon with AdamW for the rest) over decay/no-decay parameter groups, and
warmup + decay learning-rate schedules."""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from tessera.config import ConfigError, OptimConfig
from tessera.dtypes import DTYPES
from tessera.model.blocks import muon_parameters
from tessera.train.checkpoint import CheckpointError
from tessera.train.muon import MuonAdamW


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


def muon_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """Muon's matrices in one group, then :func:`parameter_groups` of the rest (AdamW)."""
    matrices = muon_parameters(model)
    ids = {id(p) for p in matrices}
    rest = parameter_groups(model, cfg.weight_decay)
    for group in rest:
        group["params"] = [p for p in group["params"] if id(p) not in ids]
    muon = {"params": matrices, "muon": True, "lr": cfg.muon.lr or cfg.lr, "weight_decay": cfg.weight_decay}
    return [muon, *rest]


def _mesh_of(param: torch.Tensor) -> DeviceMesh | None:
    """The DTensor's mesh, or None for a plain tensor: torch's fused AdamW refuses a mix in one step."""
    return param.device_mesh if isinstance(param, DTensor) else None


def adamw_kernel(params: list[torch.Tensor], implementation: str, fused_ok: bool = True) -> dict[str, bool]:
    """torch.optim.AdamW's ``fused``/``foreach`` keywords for ``optim.implementation``.

    "auto" is the fused kernel (one kernel per device and dtype, no full-size temporaries) where
    torch has it for every parameter's device and dtype (CPU, CUDA, ...) and the parameters are all
    plain tensors or all DTensors of one mesh (tensor parallelism leaves some whole), else torch's default, as
    it is when the caller says ``fused_ok=False`` (DeepSpeed: its optimizer wrapper steps it).
    """
    devices = set(_get_fused_kernels_supported_devices())  # torch's own list (no public spelling)
    fusable = all(p.device.type in devices and torch.is_floating_point(p) for p in params)
    fusable = fusable and len({_mesh_of(p) for p in params}) <= 1
    if not fused_ok and implementation == "fused":
        raise ConfigError(
            "optim.implementation='fused' is not for this optimizer's caller (DeepSpeed steps torch's default "
            "AdamW kernel); use optim.implementation='auto'"
        )
    fusable = fusable and fused_ok
    if implementation == "auto":
        return {"fused": True} if fusable else {}
    if implementation == "fused" and not fusable:
        found = sorted({f"{p.device.type}/{p.dtype}/{_mesh_of(p) or 'tensor'}" for p in params})
        raise ConfigError(
            f"optim.implementation='fused' needs floating-point parameters on {sorted(devices)}, all plain "
            f"tensors or all DTensors of one device mesh; found {found}; use optim.implementation='auto' or 'foreach'"
        )
    return {"fused": True} if implementation == "fused" else {"foreach": implementation == "foreach"}


def build_optimizer(model: nn.Module, cfg: OptimConfig, fused_ok: bool = True) -> torch.optim.Optimizer:
    """The optimizer named by ``optim.name``: torch's AdamW, or :class:`MuonAdamW` (Muon, or bf16 state).
    ``fused_ok=False``: "auto" keeps torch's default AdamW kernel (see :func:`adamw_kernel`)."""
    if cfg.name == "adamw" and cfg.state_dtype == "fp32":
        groups = parameter_groups(model, cfg.weight_decay)
        kernel = adamw_kernel([p for g in groups for p in g["params"]], cfg.implementation, fused_ok)
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kernel)
    groups = muon_groups(model, cfg) if cfg.name == "muon" else parameter_groups(model, cfg.weight_decay)
    return MuonAdamW(
        groups,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        momentum=cfg.muon.momentum,
        nesterov=cfg.muon.nesterov,
        ns_steps=cfg.muon.ns_steps,
        scale=cfg.muon.scale,
        ns_dtype=DTYPES[cfg.muon.ns_dtype],
        state_dtype=DTYPES[cfg.state_dtype],
        adamw_kernel=adamw_kernel([p for g in groups for p in g["params"]], cfg.implementation),
    )


def check_optimizer_unchanged(changes: dict[str, tuple[Any, Any]], path: Path) -> None:
    """CheckpointError when ``optim.name`` changed since ``path`` was saved: its optimizer state would not fit."""
    if "optim.name" in changes:
        old, new = changes["optim.name"]
        raise CheckpointError(
            f"checkpoint '{path}' was trained with optim.name={old}, not {new}; its optimizer state holds {old}'s "
            f"buffers: resume with optim.name={old} or start a new train.run_dir"
        )


def effective_warmup(cfg: OptimConfig, total_steps: int) -> int:
    """Warmup steps the schedule uses: ``optim.warmup_steps``, clipped to the run's length."""
    return min(cfg.warmup_steps, total_steps)


def warmup_notice(cfg: OptimConfig, total_steps: int) -> str:
    """One line when the warmup is longer than the run (a short trial), else ""."""
    if cfg.warmup_steps <= total_steps:
        return ""
    return (
        f"optim.warmup_steps={cfg.warmup_steps} is longer than train.steps={total_steps}: warming up over all "
        f"{total_steps} steps instead (set optim.warmup_steps to choose)"
    )


def lr_multiplier(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Factor on ``optim.lr`` before optimizer step ``step`` (0-based).

    Linear warmup to 1 (over at most the whole run), then cosine or linear decay to ``min_lr_ratio``,
    constant, or warmup-stable-decay (flat, then linear decay over the last ``decay_fraction`` of steps).
    """
    warmup = effective_warmup(cfg, total_steps)
    if step < warmup:
        return (step + 1) / warmup
    floor = cfg.min_lr_ratio
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "wsd":
        decay_start = max(warmup, int(total_steps * (1 - cfg.decay_fraction)))
        if step < decay_start:
            return 1.0
        progress = (step - decay_start) / max(1, total_steps - decay_start)
        return 1.0 - (1.0 - floor) * min(1.0, progress)
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
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
