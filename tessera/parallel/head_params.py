"""Tensor parallelism of per-head parameters that are neither projection rows nor columns (attention sinks).

Under TP each rank holds ``n_heads / tp`` heads (the column-parallel q projection's shard), so a
per-head vector is sharded along its only dimension, and the module hands its rank's slice to the
attention as a plain tensor: gradients flow into that rank's shard of the DTensor parameter.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle


class HeadSharded(ParallelStyle):
    """Shard every parameter of a module that returns them (e.g. :class:`~tessera.model.sinks.AttentionSinks`)
    along dim 0 over the tp mesh; its output becomes this rank's local heads."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def shard(_name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for name, param in list(mod.named_parameters(recurse=False)):
                sharded = nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]), requires_grad=param.requires_grad)
                mod.register_parameter(name, sharded)

        def local(out: Any, _mesh: DeviceMesh) -> Any:
            return out.to_local() if isinstance(out, DTensor) else out

        return distribute_module(module, device_mesh, shard, output_fn=lambda _m, out, mesh: local(out, mesh))
