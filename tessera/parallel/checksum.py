"""Parameter checksums that are the same number under every layout (for parity proofs)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

# Wrapper prefixes that activation checkpointing and torch.compile insert into parameter names.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def canonical_name(name: str) -> str:
    """A parameter's name as in the plain model (wrapper prefixes removed)."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


@torch.no_grad()
def parameter_sums_of_squares(model: nn.Module) -> dict[str, float]:
    """The sum of squares of every parameter of the whole model, by canonical name.

    Sharded parameters (FSDP, TP) are reduced over their mesh; with pipeline parallelism each
    rank holds its stages' parameters, so the per-rank tables are merged over the world. Every
    rank must call this (it runs collectives) and gets the full table.
    """
    local = {}
    for name, param in model.named_parameters():
        squares = param.detach().double().pow(2).sum()
        if isinstance(squares, DTensor):
            squares = squares.full_tensor()
        local[canonical_name(name)] = squares.item()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    tables: list[dict[str, float] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(tables, local)
    merged: dict[str, float] = {}
    for table in tables:
        merged.update(table or {})
    return dict(sorted(merged.items()))
