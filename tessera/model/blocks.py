"""Finding the transformer blocks of any zoo model (decoder, encoder, encoder-decoder) and its hidden matrices."""

from __future__ import annotations

from torch import nn

from tessera.model.moe import Experts


def block_containers(model: nn.Module) -> list[nn.ModuleDict]:
    """Every ``layers`` ModuleDict of the model: one per stack (two for encoder-decoders)."""
    return [m.layers for m in model.modules() if isinstance(getattr(m, "layers", None), nn.ModuleDict)]


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """All transformer blocks, in forward order within each stack."""
    return [block for layers in block_containers(model) for block in layers.values()]


def muon_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The hidden matrices Muon updates: every nn.Linear weight but the output head's, and MoE expert stacks."""
    head = getattr(model, "output", None)
    embeddings = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    found, seen = [], set()
    for module in model.modules():
        if module is head:
            continue
        if isinstance(module, nn.Linear):
            params = [module.weight]
        elif isinstance(module, Experts):
            params = [p for p in module.parameters(recurse=False) if p.ndim == 3]
        else:
            continue
        for p in params:
            if p.requires_grad and id(p) not in seen and id(p) not in embeddings:
                seen.add(id(p))
                found.append(p)
    return found
