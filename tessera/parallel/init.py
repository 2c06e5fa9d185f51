"""Initialization after sharding (meta-device init): per-module seeds that also name the shard."""

from __future__ import annotations

import zlib

from torch import nn
from torch.distributed.tensor import DTensor, Shard

from tessera.parallel.checksum import canonical_name


def shard_coordinates(module: nn.Module) -> tuple[int, ...]:
    """This rank's index along each mesh dimension that shards ``module``'s own parameters (empty
    when they are whole or only replicated: then every rank must draw the same numbers)."""
    for param in module.parameters(recurse=False):
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            coords = mesh.get_coordinate() or []
            return tuple(
                c for i, (c, p) in enumerate(zip(coords, param.placements)) if isinstance(p, Shard) and mesh.size(i) > 1
            )
    return ()


def shard_seeds(base: int):
    """Module seeds for :func:`tessera.model.transformer.init_weights` after sharding: the
    unsharded model's seeds (the base and the module's name) plus, for sharded parameters, the
    shard's coordinates, so the shards of one tensor are distinct draws and replicas agree."""

    def seed(name: str, module: nn.Module) -> int:
        coords = shard_coordinates(module)
        key = f"{base}/{canonical_name(name)}" + (f"/shard{coords}" if coords else "")
        return zlib.crc32(key.encode())

    return seed
