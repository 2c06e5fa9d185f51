"""Tensor parallelism inside the delta-rule mixers (Gated DeltaNet, Kimi Delta Attention): whole heads (GDN: whole
key-head groups) per tp rank.

The fused input projections are column-parallel and the output projection row-parallel (the plan
in tensor.py), so each rank computes the heads of its key-head groups end to end. What sits in
between is small and per channel or per head: the depthwise convolution's weight (channels laid
out [q | k | v], so a rank's channels are three separate ranges), the per-head ``A_log`` and
``dt_bias``, and the output norm's gain shared by all heads. They stay whole (plain tensors,
equal on every rank, as checkpoints expect); for each forward the module sees only this rank's
slice, and their gradients - each rank's nonzero on its slice only, or partial for the shared
gain - are summed over the tp ranks, so the replicas stay equal.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from tessera.model.gated_deltanet import GatedDeltaNet
from tessera.model.kimi_delta import KimiDeltaAttention


def sum_grads_over(module: nn.Module, names: list[str], mesh: DeviceMesh) -> None:
    """Sum the gradients of ``module``'s parameters ``names`` over ``mesh`` before they are accumulated
    (replicated parameters whose ranks each see part of the computation). The hooks are attached to the
    parameters the module holds when it runs: materializing a meta-initialized model replaces them."""
    group = mesh.get_group()
    hooked: set[int] = set()

    def reduce(grad: torch.Tensor) -> torch.Tensor:
        return funcol.wait_tensor(funcol.all_reduce(grad, "sum", group))

    def attach(_module: nn.Module, _args: tuple[Any, ...]) -> None:
        for name in names:
            p = module.get_parameter(name)
            if id(p) not in hooked and p.requires_grad:
                hooked.add(id(p))
                p.register_hook(reduce)

    module.register_forward_pre_hook(attach, prepend=True)


def _gated_deltanet_slices(gdn: GatedDeltaNet, rank: int, size: int) -> dict[str, tuple[int, torch.Tensor]]:
    """(dim, indices) of this rank's slice of each per-channel / per-head parameter: the convolution's channels
    [q | k | v] are three ranges, dt_bias and A_log one per value head."""
    key_dim = (gdn.conv_dim - gdn.dt_bias.shape[0] * gdn.value_head_dim) // 2
    value_dim = gdn.conv_dim - 2 * key_dim
    kl, vl = key_dim // size, value_dim // size
    conv = torch.cat(
        [torch.arange(s + rank * n, s + (rank + 1) * n) for s, n in ((0, kl), (key_dim, kl), (2 * key_dim, vl))]
    )
    heads = gdn.dt_bias.shape[0] // size
    per_head = torch.arange(rank * heads, (rank + 1) * heads)
    return {"conv1d.weight": (0, conv), "dt_bias": (0, per_head), "A_log": (0, per_head)}


def _kimi_delta_slices(kda: KimiDeltaAttention, rank: int, size: int) -> dict[str, tuple[int, torch.Tensor]]:
    """(dim, indices) for Kimi Delta Attention: its three convolutions and dt_bias per channel (heads x head_dim),
    A_log (1, 1, H, 1) per head."""
    width, heads = kda.dt_bias.shape[0] // size, kda.A_log.shape[2] // size
    channels = torch.arange(rank * width, (rank + 1) * width)
    convs = {f"{c}_conv1d.weight": (0, channels) for c in "qkv"}
    return {**convs, "dt_bias": (0, channels), "A_log": (2, torch.arange(rank * heads, (rank + 1) * heads))}


# Each delta-rule mixer: its rank's slices and the output norm's gain that all heads share.
_SLICES = {
    GatedDeltaNet: (_gated_deltanet_slices, "norm.weight"),
    KimiDeltaAttention: (_kimi_delta_slices, "o_norm.weight"),
}


class DeltaRuleHeads(ParallelStyle):
    """This rank's slice of a delta-rule mixer's convolution, decay and time-step parameters in every forward
    (see the module docstring); apply after the plan has sharded the projections."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        rank, size = device_mesh.get_local_rank(), device_mesh.size()
        slices, shared = _SLICES[type(module)]
        index = slices(module, rank, size)
        owners = {name: module.get_submodule(name.rpartition(".")[0]) for name in index}
        whole: dict[str, nn.Parameter] = {}
        sum_grads_over(module, [*index, shared], device_mesh)

        def local(_module: nn.Module, _args: tuple[Any, ...]) -> None:
            for name, owner in owners.items():  # a differentiable slice in the parameter's place
                whole[name] = p = module.get_parameter(name)  # the current one (meta init replaces them)
                dim, rows = index[name]
                owner._parameters[name.rpartition(".")[2]] = p.index_select(dim, rows.to(p.device))

        def restore(_module: nn.Module, _args: tuple[Any, ...], _out: Any) -> None:
            for name, owner in owners.items():
                owner._parameters[name.rpartition(".")[2]] = whole[name]

        module.register_forward_pre_hook(local)
        module.register_forward_hook(restore)
        return module
