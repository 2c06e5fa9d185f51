"""The one map from tessera's dtype names (``train.dtype``, ``optim.state_dtype``, cache kinds) to torch dtypes."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype tessera calls ``name`` (``fp32``, ``bf16``, ``fp16``)."""
    return DTYPES[name]
