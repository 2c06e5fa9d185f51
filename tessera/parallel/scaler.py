"""The fp16 loss scaler for every layout."""

from __future__ import annotations

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler


def build_grad_scaler(device: torch.device, enabled: bool, distributed: bool) -> torch.amp.GradScaler:
    """torch's GradScaler, or on several processes its sharded variant.

    With sharded (FSDP, TP) or split (PP) gradients each rank sees only part of them, so whether
    any overflowed must be decided by all ranks together: ShardedGradScaler all-reduces the
    found-inf flag over the world before the optimizer step is taken or skipped everywhere.
    """
    if distributed and enabled:
        return _ShardedScaler(device.type, enabled=True)
    return torch.amp.GradScaler(device.type, enabled=enabled)


class _ShardedScaler(ShardedGradScaler):
    """ShardedGradScaler whose found-inf flags are scalars, as GradScaler's are: torch 2.13's sharded
    scaler makes them shape (1,), which a fused optimizer (AdamW ``fused=True``, ``optim.implementation``
    "auto") cannot subtract in place from its scalar step counts."""

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale and agree on overflow over all ranks (see ShardedGradScaler), flags as scalars."""
        super().unscale_(optimizer)
        state = self._per_optimizer_states[id(optimizer)]
        state["found_inf_per_device"] = {dev: t.reshape(()) for dev, t in state["found_inf_per_device"].items()}
