"""Finding the transformer blocks of any zoo model (decoder, encoder, encoder-decoder)."""

from __future__ import annotations

from torch import nn


def block_containers(model: nn.Module) -> list[nn.ModuleDict]:
    """Every ``layers`` ModuleDict of the model: one per stack (two for encoder-decoders)."""
    return [m.layers for m in model.modules() if isinstance(getattr(m, "layers", None), nn.ModuleDict)]


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """All transformer blocks, in forward order within each stack."""
    return [block for layers in block_containers(model) for block in layers.values()]
