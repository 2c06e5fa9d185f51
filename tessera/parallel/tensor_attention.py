"""Tensor-parallel plans of the attention variants whose state is not simply "heads": latent attention
(DeepSeek-V2/V3) and QK-norm over all heads (OLMo 2, OLMoE).

**Latent attention.** The heads only exist after the low-rank projections, so the split comes there:
``q_a_proj``/``kv_a_proj_with_mqa`` and their norms (``q_a_layernorm``, ``kv_a_layernorm``: over the
latent, not over heads) run replicated on every tp rank; ``q_b_proj``/``kv_b_proj`` (or ``q_proj``
without a query bottleneck) are column-parallel (each rank expands its heads) and ``o_proj``
row-parallel. With sequence parallelism the low-rank projections run on the rank's slice of the
sequence and their narrow outputs (``q_rank``, ``kv_rank + rope_head_dim`` channels, against
``dim`` for standard attention) are what is all-gathered. The decoupled RoPE key is shared by every
head but leaves ``kv_a_proj_with_mqa`` outside any column-parallel projection, so each rank's
gradient for it covers only its heads: :func:`shared_across_ranks` sums it over the tp ranks in
backward (Megatron's "copy to tensor-parallel region", written with DTensor).

**DeepSeek Sparse Attention** is latent attention plus a lightning indexer, which stays replicated: it reads
the detached block input (all-gathered under sequence parallelism) and the whole latent query, so every
rank computes the same scores and the same top-k, global over the sequence. The indexer's KL target (the
main attention's weights summed over heads) is summed over the tp ranks' heads, so every rank's indexer
takes the same gradient; the sparse core reads its own heads' rows of ``kv_b_proj`` and the whole latent
(whose gradient, from each rank's heads, is summed over the ranks: :class:`SparseHeads`).

**QK-norm over all heads.** The RMSNorm spans the whole q (k) projection, whose channels
tensor parallelism splits: its weight is sharded like the projection's output (``Shard(0)``) and the
norm runs on the ``Shard(-1)`` DTensor of the local channels, so DTensor all-reduces the mean of the
squares over the tp ranks (forward and backward) and the statistics are those of every head.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from tessera.model.dsa import HeadGroup


def shared_across_ranks(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Identity forward; backward sums the gradient over ``mesh`` (a value every tp rank consumes with its
    own heads)."""
    return DTensor.from_local(x, mesh, (Replicate(),), run_check=False).to_local(grad_placements=(Partial(),))


class LowRankProjection(ParallelStyle):
    """A latent attention down-projection (``q_a_proj``, ``kv_a_proj_with_mqa``), replicated on every tp rank.

    ``sequence_sharded``: the input is the rank's Shard(1) slice; the projection runs on it and its
    (narrow) output is all-gathered to the whole sequence. ``shared_from``: output channels from there on
    (the decoupled RoPE key) feed every rank's heads directly; their gradient is summed over the ranks.
    The output is a plain tensor either way.
    """

    def __init__(self, sequence_sharded: bool, shared_from: int | None = None) -> None:
        super().__init__()
        self.sequence_sharded, self.shared_from = sequence_sharded, shared_from

    def _shared(self, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        if self.shared_from is None:
            return out
        own, shared = out.split([self.shared_from, out.shape[-1] - self.shared_from], dim=-1)
        return torch.cat([own, shared_across_ranks(shared, mesh)], dim=-1)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not self.sequence_sharded:  # whole input on every rank: plain replicated weights, no communication
            module.register_forward_hook(lambda _m, _a, out: self._shared(out, device_mesh))
            return module

        def shard_input(_m: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
            x = inputs[0]
            x = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, (Shard(1),), run_check=False)
            return (x, *inputs[1:])

        def gather_output(_m: nn.Module, out: DTensor, mesh: DeviceMesh) -> torch.Tensor:
            return self._shared(out.redistribute(mesh, (Replicate(),)).to_local(), mesh)

        return distribute_module(module, device_mesh, input_fn=shard_input, output_fn=gather_output)


def _whole(x: torch.Tensor) -> torch.Tensor:
    return x.full_tensor() if isinstance(x, DTensor) else x


def _local(w: torch.Tensor) -> torch.Tensor:
    return w.to_local() if isinstance(w, DTensor) else w


class SparseHeads(ParallelStyle):
    """DSA's :class:`~tessera.model.dsa.HeadGroup` over the tp ranks (see the module docstring): the block
    input whole, the indexer's KL target summed over every rank's heads, ``kv_b_proj`` as this rank's rows."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()

        def sum_heads(t: torch.Tensor) -> torch.Tensor:  # detached: a plain all-reduce, no autograd
            return funcol.wait_tensor(funcol.all_reduce(t, "sum", group))

        def shared(t: torch.Tensor) -> torch.Tensor:
            return shared_across_ranks(t, device_mesh)

        module.heads = HeadGroup(whole_input=_whole, sum_heads=sum_heads, local=_local, shared=shared)
        return module


def latent_attention_plan(prefix: str, attention: nn.Module, sp: bool) -> dict[str, ParallelStyle]:
    """The plan of one :class:`~tessera.model.mla.LatentAttention` (see the module docstring)."""
    stream = Shard(1) if sp else Replicate()
    plan: dict[str, ParallelStyle] = {
        f"{prefix}.kv_a_proj_with_mqa": LowRankProjection(sp, shared_from=attention.kv_rank),
        f"{prefix}.kv_b_proj": ColwiseParallel(),
        f"{prefix}.o_proj": RowwiseParallel(output_layouts=stream, use_local_output=not sp),
    }
    if attention.q_proj is not None:
        plan[f"{prefix}.q_proj"] = ColwiseParallel(input_layouts=stream)
    else:
        plan[f"{prefix}.q_b_proj"] = ColwiseParallel()
        if sp:
            plan[f"{prefix}.q_a_proj"] = LowRankProjection(sp)
    if getattr(attention, "indexer", None) is not None:
        plan[prefix] = SparseHeads()
    return plan


class AllHeadsNorm(ParallelStyle):
    """An RMSNorm over a column-parallel projection's whole output: weight Shard(0), input the local channels
    as a Shard(-1) DTensor (DTensor reduces the statistics over the ranks), output the local channels."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def shard_weight(_name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for name, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, (Shard(0),))))

        def channels(_m: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
            x = inputs[0]
            x = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, (Shard(-1),), run_check=False)
            return (x, *inputs[1:])

        def local(_m: nn.Module, out: DTensor, _mesh: DeviceMesh) -> torch.Tensor:
            return out.to_local()

        return distribute_module(module, device_mesh, shard_weight, input_fn=channels, output_fn=local)


def all_heads_norm_plan(prefix: str, attention: nn.Module) -> dict[str, ParallelStyle]:
    """Sharded norms for an attention whose QK-norm spans all heads (``qk_norm_scope = "all"``), else none."""
    if getattr(attention, "q_norm", None) is None or not getattr(attention, "qk_norm_all", False):
        return {}
    return {f"{prefix}.q_norm": AllHeadsNorm(), f"{prefix}.k_norm": AllHeadsNorm()}
