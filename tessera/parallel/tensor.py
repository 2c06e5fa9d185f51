"""Tensor and sequence parallelism for zoo decoders, through DTensor ``parallelize_module``.

Megatron-style layout: Q/K/V and gate/up projections are column-parallel (heads and hidden
units split across the tp ranks), the attention output and down projections row-parallel, so
each block needs one collective after attention and one after the feed-forward. With sequence
parallelism the residual stream between those regions stays sharded along the sequence: norms
and dropout run on 1/tp of the tokens, and the all-reduces become reduce-scatter/all-gather
pairs. The embedding is vocab-parallel and the output head column-parallel with its logits
left sharded over the vocabulary, so the loss runs under ``loss_parallel`` and the full
logits never materialize on one rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


class ReplicateInput(ParallelStyle):
    """Before the module runs, make its first input a replicated DTensor over the tp mesh.

    With sequence parallelism the input arrives sharded along the sequence and is all-gathered
    here, once for all the column-parallel projections that follow; without it the input is
    already whole and is only wrapped, so backward sums the projections' input gradients
    locally and all-reduces once instead of once per projection. Only the first positional
    argument (the hidden states) is touched, so the module's other arguments pass through.
    """

    def __init__(self, sequence_sharded: bool) -> None:
        super().__init__()
        self.src = (Shard(1),) if sequence_sharded else (Replicate(),)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def replicate(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]):
            x = args[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, self.src, run_check=False)
            return (x.redistribute(device_mesh, (Replicate(),)), *args[1:]), kwargs

        module.register_forward_pre_hook(replicate, with_kwargs=True)
        return module


class ReplicatedRegion(ParallelStyle):
    """Run a module unsharded on every tp rank, between sequence-parallel regions.

    The sequence-sharded input is gathered and handed over as a plain tensor; the (identical)
    output is re-sharded along the sequence. Used for MoE layers, whose experts stay
    replicated across tp ranks until expert parallelism shards them.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(_module: nn.Module, args: tuple[Any, ...]):
            x = args[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, (Shard(1),), run_check=False)
            return (x.redistribute(device_mesh, (Replicate(),)).to_local(), *args[1:])

        def scatter(_module: nn.Module, _args: tuple[Any, ...], out: torch.Tensor):
            return DTensor.from_local(out, device_mesh, (Replicate(),), run_check=False).redistribute(
                device_mesh, (Shard(1),)
            )

        module.register_forward_pre_hook(gather)
        module.register_forward_hook(scatter)
        return module


def _block_plan(block: nn.Module, sp: bool) -> dict[str, ParallelStyle]:
    out = Shard(1) if sp else Replicate()
    plan: dict[str, ParallelStyle] = {
        "attention.q_proj": ColwiseParallel(),
        "attention.k_proj": ColwiseParallel(),
        "attention.v_proj": ColwiseParallel(),
        "attention.o_proj": RowwiseParallel(output_layouts=out, use_local_output=not sp),
    }
    plan["attention"] = ReplicateInput(sp)
    if sp:
        plan.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()})
    if block.moe is not None:
        if sp:
            plan["moe"] = ReplicatedRegion()
        return plan
    plan.update(
        {
            "feed_forward.up_proj": ColwiseParallel(),
            "feed_forward.down_proj": RowwiseParallel(output_layouts=out, use_local_output=not sp),
        }
    )
    if getattr(block.feed_forward, "gate_proj", None) is not None:
        plan["feed_forward.gate_proj"] = ColwiseParallel()
    plan["feed_forward"] = ReplicateInput(sp)
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Shard a zoo decoder over ``tp_mesh`` in place (see the module docstring for the layout)."""
    sp = sequence_parallel
    root_plan: dict[str, ParallelStyle] = {
        # Under SP the embedding output stays a DTensor so the stack sees the global sequence length.
        "tok_embeddings": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate(), use_local_output=not sp
        ),
        "output": ColwiseParallel(
            input_layouts=Shard(1) if sp else Replicate(), output_layouts=Shard(-1), use_local_output=False
        ),
    }
    if sp:
        root_plan["norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, root_plan)
    for block in model.layers.values():
        # Attention derives its local head count from the sharded projections' widths.
        parallelize_module(block, tp_mesh, _block_plan(block, sp))
