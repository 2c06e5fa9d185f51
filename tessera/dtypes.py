"""The one map from tessera's dtype names (``train.dtype``, ``optim.state_dtype``, cache kinds) to torch dtypes."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype tessera calls ``name`` (``fp32``, ``bf16``, ``fp16``)."""
    return DTYPES[name]


def autocast_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` in autocast's dtype when autocast is on for its device (else ``x``): cast once for the several
    projections that read it (q, k and v; gate and up), each of which would otherwise cast it again in forward
    and convert its gradient back in backward."""
    device = x.device.type
    if not torch.is_autocast_enabled(device) or not x.is_floating_point():
        return x
    dtype = torch.get_autocast_dtype(device)
    return x if x.dtype == dtype else x.to(dtype)
