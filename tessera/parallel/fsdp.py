"""Data parallelism: FSDP2 (ZeRO-3 / ZeRO-2), HSDP and DDP, with mixed precision and offload."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from tessera.model.blocks import block_containers
from tessera.parallel.expert import shard_experts


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    param_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    experts: tuple[DeviceMesh, int] | None = None,
) -> None:
    """``fully_shard`` every block, then the root (embedding, final norm, head).

    A 1-D mesh shards (FSDP); a 2-D (replicate, shard) mesh gives HSDP. Parameters are cast
    to ``param_dtype`` for compute while gradients are reduced in float32.
    ``reshard_after_forward=False`` keeps gathered parameters until backward (ZeRO-2 memory,
    fewer all-gathers).
    With expert parallelism, ``experts`` is (the efsdp or ehsdp mesh, the data-parallel degree):
    each block's experts are sharded over that mesh first (:func:`shard_experts`).
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    for layers in block_containers(model):
        blocks = list(layers.values())
        for i, block in enumerate(blocks):
            # The last block's parameters are needed again at once by backward: keep them gathered.
            reshard = reshard_after_forward and i < len(blocks) - 1
            if experts is not None:
                shard_experts(block, experts[0], mp, offload, reshard, experts[1])
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard, offload_policy=offload)
    # Multi-token prediction: each module's block is a unit; its norms and projection (its final norm runs
    # outside the module's forward) stay with the root.
    for module in (getattr(model, "mtp", None) or {}).values():
        fully_shard(
            module.block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, offload_policy=offload
        )
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, offload_policy=offload)


def apply_ddp(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Plain data parallelism: every rank holds everything, gradients are all-reduced."""
    from torch.distributed._composable.replicate import replicate

    return replicate(model, device_mesh=mesh, bucket_cap_mb=100)
