"""Tensor parallelism inside the recurrent mixers (Gated DeltaNet, Kimi Delta Attention, Mamba, Mamba-2): whole
heads or channels per tp rank, each rank scanning its own.

**Gated DeltaNet, Kimi Delta Attention.** The input projections are column-parallel and the output projection
row-parallel (the plan registered with the mixer): HF's per-key-head layout gives each rank whole GDN key-head
groups, KDA's separate q, k, v projections whole heads. What sits in between is small and per channel or per head:
the depthwise convolution's weight (GDN's channels laid out [q | k | v], so a rank's channels are three separate
ranges; KDA's three convolutions one range each), the per-head ``A_log`` and the per-head (GDN) or per-channel
(KDA) ``dt_bias``, and the output norm's gain shared by all heads.

**Mamba, Mamba-2.** HF's fused input projection is laid out by role ([x | z], or [z | x | B | C | dt]), not by
head, so a contiguous column shard would hand one rank all of x and the other all of z. Every parameter of the
mixer therefore stays whole and each rank takes its rows (channels, heads, Mamba-2's B/C groups) for each forward:
the compute, the scan and its activations are split over tp, the parameters are not (the planner divides no Mamba
weight by tp). The mixer's input is the whole sequence on every rank (gathered under SP) and its gradient is summed
over the ranks; each rank's output projection gives a partial sum, reduced (all-reduce, or reduce-scatter to the
sequence-parallel stream). Mamba-1's ``x_proj`` reads the local channels, so its (narrow) output is summed over the
ranks in both directions; the output bias is added by the first rank only.

Sliced parameters stay plain tensors, equal on every rank, as checkpoints expect; their gradients - each rank's
nonzero on its slice only, or partial for what all ranks read - are summed over the tp ranks, so the replicas stay
equal.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from tessera.model.gated_deltanet import GatedDeltaNet
from tessera.model.kimi_delta import KimiDeltaAttention

Slices = dict[str, tuple[int, torch.Tensor]]  # parameter name -> (dim, indices along it) of this rank's slice


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


def slice_parameters(module: nn.Module, slices: Slices) -> None:
    """For each forward of ``module``, its parameters ``slices`` names are replaced by this rank's (differentiable)
    slices, and put back after."""
    owners = {name: module.get_submodule(name.rpartition(".")[0]) for name in slices}
    whole: dict[str, nn.Parameter] = {}

    def local(_module: nn.Module, _args: tuple[Any, ...]) -> None:
        for name, owner in owners.items():
            dim, index = slices[name]
            whole[name] = p = module.get_parameter(name)  # the current one (meta init replaces them)
            owner._parameters[name.rpartition(".")[2]] = p.index_select(dim, index.to(p.device))

    def restore(_module: nn.Module, _args: tuple[Any, ...], _out: Any) -> None:
        for name, owner in owners.items():
            owner._parameters[name.rpartition(".")[2]] = whole[name]

    module.register_forward_pre_hook(local)
    module.register_forward_hook(restore)


def _ranges(*spans: tuple[int, int]) -> torch.Tensor:
    """The indices of several (start, length) ranges, concatenated."""
    return torch.cat([torch.arange(start, start + length) for start, length in spans])


def _gdn_slices(gdn: nn.Module, rank: int, size: int) -> Slices:
    """Indices (dim 0) of this rank's slice of each per-channel / per-head parameter."""
    key_dim = (gdn.conv_dim - gdn.dt_bias.shape[0] * gdn.value_head_dim) // 2
    value_dim = gdn.conv_dim - 2 * key_dim
    kl, vl = key_dim // size, value_dim // size
    conv = _ranges((rank * kl, kl), (key_dim + rank * kl, kl), (2 * key_dim + rank * vl, vl))
    heads = gdn.dt_bias.shape[0] // size
    per_head = _ranges((rank * heads, heads))
    return {"conv1d.weight": (0, conv), "dt_bias": (0, per_head), "A_log": (0, per_head)}


def _kimi_delta_slices(kda: nn.Module, rank: int, size: int) -> Slices:
    """Kimi Delta Attention's: its three convolutions and dt_bias per channel (heads x head_dim), A_log
    (1, 1, H, 1) per head."""
    width, heads = kda.dt_bias.shape[0] // size, kda.A_log.shape[2] // size
    channels = _ranges((rank * width, width))
    convs = {f"{c}_conv1d.weight": (0, channels) for c in "qkv"}
    return {**convs, "dt_bias": (0, channels), "A_log": (2, _ranges((rank * heads, heads)))}


# Each delta-rule mixer: its rank's slices and the output norm's gain that all heads share.
_DELTA_RULE_SLICES = {
    GatedDeltaNet: (_gdn_slices, "norm.weight"),
    KimiDeltaAttention: (_kimi_delta_slices, "o_norm.weight"),
}


class DeltaRuleHeads(ParallelStyle):
    """This rank's slice of a delta-rule mixer's convolution, decay and time-step parameters in every forward
    (see the module docstring); apply after the plan has sharded the projections."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        slicer, shared = _DELTA_RULE_SLICES[type(module)]
        slices = slicer(module, device_mesh.get_local_rank(), device_mesh.size())
        sum_grads_over(module, [*slices, shared], device_mesh)
        slice_parameters(module, slices)
        return module


def _mamba_slices(mixer: nn.Module, rank: int, size: int) -> Slices:
    """This rank's rows of every per-channel parameter of a Mamba ([x | z]) or Mamba-2 ([z | x | B | C | dt])
    mixer, and its columns of ``x_proj`` / ``out_proj``; the output bias, which every rank would add, is kept
    whole and zeroed by :class:`MambaChannels` on all ranks but the first."""
    inner = mixer.inner
    if mixer.A_log.dim() == 2:  # Mamba-1: a state per channel
        n = inner // size
        ch = _ranges((rank * n, n))
        rows = {"in_proj": torch.cat([ch, inner + ch]), "conv1d": ch, "dt_proj": ch, "A_log": ch, "D": ch}
        columns = {"x_proj.weight": (1, ch), "out_proj.weight": (1, ch)}
    else:
        h, g, bc = mixer.heads // size, mixer.groups // size, mixer.groups * mixer.state
        heads = _ranges((rank * h, h))
        ch = _ranges((rank * h * mixer.head_dim, h * mixer.head_dim))
        groups = _ranges((rank * g * mixer.state, g * mixer.state))
        conv = torch.cat([ch, inner + groups, inner + bc + groups])
        in_proj = torch.cat([ch, inner + conv, inner + mixer.conv_dim + heads])
        rows = {"in_proj": in_proj, "conv1d": conv, "dt_bias": heads, "A_log": heads, "D": heads, "norm": ch}
        columns = {"out_proj.weight": (1, ch)}
    slices: Slices = dict(columns)
    for name, _ in mixer.named_parameters():
        owner = name.removesuffix(".weight").removesuffix(".bias")
        if owner in rows and name not in slices:
            slices[name] = (0, rows[owner])
    return slices


def _sum_both_ways(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Sum over ``mesh`` forward and backward: a partial value every rank reads whole and each rank's use of
    which is part of the computation (Mamba-1's ``x_proj`` output)."""
    return _SumBothWays.apply(x, mesh.get_group())


class _SumBothWays(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "sum", group))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return funcol.wait_tensor(funcol.all_reduce(grad.contiguous(), "sum", ctx.group)), None


class MambaChannels(ParallelStyle):
    """A Mamba / Mamba-2 mixer split by channels and heads over the tp ranks (see the module docstring); its
    input arrives as a replicated DTensor (the block plan's ``ReplicateInput``), its output leaves in the
    residual stream's layout (``Shard(1)`` under sequence parallelism)."""

    def __init__(self, sequence_parallel: bool) -> None:
        super().__init__()
        self.stream = (Shard(1),) if sequence_parallel else (Replicate(),)
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        rank = device_mesh.get_local_rank()
        slices = _mamba_slices(module, rank, device_mesh.size())
        sum_grads_over(module, [name for name, _ in module.named_parameters()], device_mesh)
        slice_parameters(module, slices)
        if getattr(module.out_proj, "bias", None) is not None and rank > 0:
            _zero_bias(module.out_proj)
        if isinstance(getattr(module, "x_proj", None), nn.Module):
            module.x_proj.register_forward_hook(lambda _m, _a, out: _sum_both_ways(out, device_mesh))

        def whole_input(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            x = args[0]
            if isinstance(x, DTensor):  # each rank's input gradient is partial: summed over the ranks
                x = x.redistribute(device_mesh, (Replicate(),)).to_local(grad_placements=(Partial(),))
            return (x, *args[1:])

        def reduce_output(_module: nn.Module, _args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
            summed = DTensor.from_local(out, device_mesh, (Partial(),), run_check=False).redistribute(
                device_mesh, self.stream
            )
            return summed if self.sequence_parallel else summed.to_local()

        module.register_forward_pre_hook(whole_input)
        module.register_forward_hook(reduce_output)
        return module


def _zero_bias(linear: nn.Module) -> None:
    """The bias of ``linear`` times zero in each forward (its output is one rank's part of a sum over the ranks)."""
    whole: dict[str, nn.Parameter] = {}

    def zeroed(_module: nn.Module, _args: tuple[Any, ...]) -> None:
        whole["bias"] = p = linear._parameters["bias"]
        linear._parameters["bias"] = p * 0

    def restore(_module: nn.Module, _args: tuple[Any, ...], _out: Any) -> None:
        linear._parameters["bias"] = whole["bias"]

    linear.register_forward_pre_hook(zeroed)
    linear.register_forward_hook(restore)
