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
        return ShardedGradScaler(device.type, enabled=True)
    return torch.amp.GradScaler(device.type, enabled=enabled)
