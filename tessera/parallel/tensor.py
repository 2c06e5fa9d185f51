"""Tensor and sequence parallelism for zoo models (decoder, encoder, encoder-decoder) through DTensor.

Megatron-style layout: Q/K/V and gate/up projections are column-parallel (heads and hidden
units split across the tp ranks), the attention output and down projections row-parallel, so
each block needs one collective after attention and one after the feed-forward. With sequence
parallelism the residual stream between those regions stays sharded along the sequence: norms
and dropout run on 1/tp of the tokens, and the all-reduces become reduce-scatter/all-gather
pairs. The embedding is vocab-parallel and the output head column-parallel with its logits
left sharded over the vocabulary, so the loss runs under ``loss_parallel`` and the full
logits never materialize on one rank; a tied embedding and head are one weight sharded along
the vocabulary for both. Cross-attention reads the encoder output replicated; score biases are
per head (T5's bucket table sharded by head, ALiBi's slopes sliced). When positions, token types
or an embedding norm act on the embedding output, it stays replicated until the first block.
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
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from tessera import registry
from tessera.model.ffn import DENSE
from tessera.parallel.head_params import HeadSharded
from tessera.model.mla import LatentAttention
from tessera.parallel.tensor_attention import all_heads_norm_plan, latent_attention_plan
from tessera.model.gated_deltanet import DeltaRuleMixer
from tessera.parallel.recurrent import DeltaRuleHeads, MambaChannels


class ReplicateInput(ParallelStyle):
    """Before the module runs, make its first input a replicated DTensor over the tp mesh.

    With sequence parallelism the input arrives sharded along the sequence and is all-gathered
    here, once for all the column-parallel projections that follow; without it the input is
    already whole and is only wrapped, so backward sums the projections' input gradients
    locally and all-reduces once instead of once per projection. Only the first positional
    argument (the hidden states) and cross-attention's ``memory`` keyword (the encoder output,
    read by the column-parallel k/v projections) are touched; other arguments pass through.
    """

    def __init__(self, sequence_sharded: bool) -> None:
        super().__init__()
        self.src = (Shard(1),) if sequence_sharded else (Replicate(),)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def replicate(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]):
            x = args[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, self.src, run_check=False)
            memory = kwargs.get("memory")
            if memory is not None:
                if not isinstance(memory, DTensor):  # without SP the encoder output is whole on every rank
                    memory = DTensor.from_local(memory, device_mesh, (Replicate(),), run_check=False)
                kwargs = {**kwargs, "memory": memory.redistribute(device_mesh, (Replicate(),))}
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


class ShardSequence(ParallelStyle):
    """Enter the sequence-parallel region: a replicated input becomes this rank's Shard(1) slice.

    Used before a stack's first block when positions, token types or an embedding norm are
    applied to the whole replicated embedding output first (a local slice, no communication).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def shard(_module: nn.Module, args: tuple[Any, ...]):
            x = args[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, (Replicate(),), run_check=False)
            return (x.redistribute(device_mesh, (Shard(1),)), *args[1:])

        module.register_forward_pre_hook(shard)
        return module


class LocalHeads(ParallelStyle):
    """Keep this rank's heads (dim 1) of a module's replicated (B, H, Tq, Tk) score bias (ALiBi)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        rank, size = device_mesh.get_local_rank(), device_mesh.size()

        def local(_module: nn.Module, _args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
            return out.chunk(size, dim=1)[rank]

        module.register_forward_hook(local)
        return module


def _styles(prefix: str, tp_plan: dict[str, str] | None, sp: bool, module: nn.Module) -> dict[str, ParallelStyle]:
    """A component spec's TP plan (submodule -> "colwise" | "rowwise", see tessera.registry) as DTensor
    styles for the submodules ``module`` has; row-parallel outputs reduce to the stream's layout. A spec
    without a plan (Mamba: compat refuses tp) splits nothing (what the planner reads)."""
    out = Shard(1) if sp else Replicate()
    make = {
        "colwise": ColwiseParallel,
        "colwise_gathered": lambda: ColwiseParallel(output_layouts=Replicate()),  # a low-rank half, then gathered
        "rowwise": lambda: RowwiseParallel(output_layouts=out, use_local_output=not sp),
    }
    return {f"{prefix}.{name}": make[style]() for name, style in (tp_plan or {}).items() if hasattr(module, name)}


def _qk_norm_plan(prefix: str, module: nn.Module) -> dict[str, ParallelStyle]:
    """Per-head QK-norm (Qwen3) runs on this rank's heads (B, H/tp, T, D): its weight is shared by all heads,
    so its gradient is a sum over the tp ranks' heads. As a Replicate DTensor over a head-sharded (dim 1)
    input, DTensor reduces it; as a plain tensor each rank kept only its part."""
    if getattr(module, "q_norm", None) is None or getattr(module, "qk_norm_all", True):
        return {}
    head_sharded = {name: SequenceParallel(sequence_dim=1, use_local_output=True) for name in ("q_norm", "k_norm")}
    return {f"{prefix}.{name}": style for name, style in head_sharded.items()}


def _attention_plan(prefix: str, sp: bool, module: nn.Module) -> dict[str, ParallelStyle]:
    plan = {**_styles(prefix, registry.ATTENTION_TP, sp, module), prefix: ReplicateInput(sp)}
    return {**plan, **_qk_norm_plan(prefix, module)}


def _block_plan(block: nn.Module, sp: bool) -> dict[str, ParallelStyle]:
    mixer = block.mixer_spec  # compat refuses tp for a mixer without a TP plan
    module = getattr(block, mixer.attr)
    if isinstance(module, LatentAttention):  # heads split after the low-rank projections
        plan = latent_attention_plan(mixer.attr, module, sp)
    else:
        plan = {**_styles(mixer.attr, mixer.tp_plan, sp, module), mixer.attr: ReplicateInput(sp)}
        plan.update(all_heads_norm_plan(mixer.attr, module))  # QK-norm over all heads: statistics over the ranks
        plan.update(_qk_norm_plan(mixer.attr, module))  # per-head QK-norm: its weight's gradient over the ranks
    if getattr(getattr(block, mixer.attr), "sinks", None) is not None:  # per-head sink logits follow the heads
        plan[f"{mixer.attr}.sinks"] = HeadSharded()
    if block.cross_attention is not None:  # its k/v read the encoder memory, replicated like its input
        plan.update(_attention_plan("cross_attention", sp, block.cross_attention))
    if sp:
        norms = [f"{mixer.attr}_norm", "ffn_norm"] + (["cross_attention_norm"] if block.cross_attention else [])
        norms += [f"{mixer.attr}_post_norm", "ffn_post_norm"]  # sandwich norms (absent ones are skipped)
        plan.update({name: SequenceParallel() for name in norms})
    if block.moe is not None:
        if sp:
            plan["moe"] = ReplicatedRegion()
        return plan
    ffn = block.feed_forward
    plan.update(_styles("feed_forward", DENSE.tp_plan, sp, ffn))
    plan["feed_forward"] = ReplicateInput(sp)
    return plan


def tp_sharded_modules(block: nn.Module) -> frozenset[str]:
    """The modules of ``block`` the TP plan splits over the tp ranks (column- or row-parallel), by name in the
    block: what the planner divides by tp (the plan is stated once, here)."""
    plan = _present(block, _block_plan(block, sp=False))
    return frozenset(name for name, style in plan.items() if isinstance(style, (ColwiseParallel, RowwiseParallel)))


class SequenceShardInputs(ParallelStyle):
    """Before a multi-token-prediction module: its (hidden, embedded) inputs as Shard(1) DTensors.

    The hidden states arrive sequence-sharded from the final norm; the embeddings of the tokens
    ahead arrive whole (replicated) from a pipeline's first stage, or from a replicated embedding,
    and are sliced locally.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def shard(_module: nn.Module, args: tuple[Any, ...]):
            def sharded(x: torch.Tensor) -> torch.Tensor:
                if not isinstance(x, DTensor):
                    x = DTensor.from_local(x, device_mesh, (Replicate(),), run_check=False)
                return x.redistribute(device_mesh, (Shard(1),))

            return (sharded(args[0]), sharded(args[1]), *args[2:])

        module.register_forward_pre_hook(shard)
        return module


def _mtp_plan(sp: bool) -> dict[str, ParallelStyle]:
    """One MTP module's norms and projection (its block gets the blocks' plan): the projection of the
    concatenated (embedding, hidden) pair is column-parallel and gathers its output back to the
    residual stream's layout."""
    stream = Shard(1) if sp else Replicate()
    plan: dict[str, ParallelStyle] = {
        "eh_proj": ColwiseParallel(input_layouts=stream, output_layouts=stream, use_local_output=not sp)
    }
    if sp:
        plan.update({name: SequenceParallel() for name in ("enorm", "hnorm", "norm")})
        plan[""] = SequenceShardInputs()
    return plan


def _stacks(model: nn.Module) -> list[nn.Module]:
    """The block stacks of a zoo model: itself (decoder, encoder) or its encoder and decoder."""
    stacks = [model.encoder, model.decoder] if hasattr(model, "encoder") else [model]
    return [stack for stack in stacks if stack is not None]  # a pipeline stage may lack one


def _embeds_before_blocks(model: nn.Module) -> bool:
    """Whether something is added to the embedding output before the first block (positions,
    token types, an embedding norm): then it runs replicated and the sequence is split after it."""
    parts = [getattr(model, "type_embeddings", None)]
    parts += [getattr(stack, name, None) for stack in _stacks(model) for name in ("pos_embeddings", "embed_norm")]
    return any(part is not None for part in parts)


def _root_plan(model: nn.Module, sp: bool, replicated_embedding: bool) -> dict[str, ParallelStyle]:
    sharded_out = sp and not replicated_embedding
    plan: dict[str, ParallelStyle] = {
        # Under SP the embedding output stays a DTensor so the stack sees the global sequence length.
        "tok_embeddings": RowwiseParallel(
            input_layouts=Replicate(),
            output_layouts=Shard(1) if sharded_out else Replicate(),
            use_local_output=not sharded_out,
        ),
    }
    head = getattr(model, "head", None)  # BERT's MLM transform runs replicated on the gathered sequence
    if head is not None and sp:
        plan["head"] = PrepareModuleInput(
            input_layouts=Shard(1), desired_input_layouts=Replicate(), use_local_output=True
        )
    head_input = Shard(1) if sp and head is None else Replicate()
    plan["output"] = ColwiseParallel(input_layouts=head_input, output_layouts=Shard(-1), use_local_output=False)
    return plan


def _stack_plan(stack: nn.Module, sp: bool) -> dict[str, ParallelStyle]:
    plan: dict[str, ParallelStyle] = {}
    if sp and getattr(stack, "norm", None) is not None:
        plan["norm"] = SequenceParallel()
    bias = getattr(stack, "rel_bias", None)
    if bias is not None:  # score biases are per head: T5's table is sharded by head, ALiBi sliced
        key = "rel_bias.relative_attention_bias"
        plan.update(
            {key: ColwiseParallel()} if hasattr(bias, "relative_attention_bias") else {"rel_bias": LocalHeads()}
        )
    return plan


def _replicated_partial_grads(block: nn.Module, tp_mesh: DeviceMesh, sp: bool) -> None:
    """The recurrent mixers' parameters sliced per rank (tessera/parallel/recurrent.py): gradients summed over the
    tp ranks. (Per-head QK-norm gains are Replicate DTensors through :func:`_qk_norm_plan`; DTensor sums theirs.)"""
    mixer = getattr(block, block.mixer_spec.attr, None)
    if isinstance(mixer, DeltaRuleMixer):
        parallelize_module(mixer, tp_mesh, DeltaRuleHeads())
    if getattr(block, "mamba", None) is not None:
        parallelize_module(block.mamba, tp_mesh, MambaChannels(sp))


def _present(model: nn.Module, plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """The plan's entries whose module exists (a pipeline stage lacks the other stages' parts)."""
    out = {}
    for key, style in plan.items():
        try:
            if model.get_submodule(key) is not None:
                out[key] = style
        except AttributeError:
            continue
    return out


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Shard a zoo model (decoder, encoder, encoder-decoder) over ``tp_mesh`` in place (see the
    module docstring for the layout); a tied embedding and head share one vocab-sharded weight."""
    sp = sequence_parallel
    embedding, head = getattr(model, "tok_embeddings", None), getattr(model, "output", None)
    tied = embedding is not None and head is not None and head.weight is embedding.weight
    replicated_embedding = _embeds_before_blocks(model)
    parallelize_module(model, tp_mesh, _present(model, _root_plan(model, sp, replicated_embedding)))
    for stack in _stacks(model):
        parallelize_module(stack, tp_mesh, _present(stack, _stack_plan(stack, sp)))
        blocks = list(stack.layers.values())
        for block in blocks:
            # Attention derives its local head count from the sharded projections' widths.
            parallelize_module(block, tp_mesh, _present(block, _block_plan(block, sp)))
            _replicated_partial_grads(block, tp_mesh, sp)
        if sp and replicated_embedding and blocks:
            parallelize_module(blocks[0], tp_mesh, ShardSequence())
    for module in (getattr(model, "mtp", None) or {}).values():  # multi-token prediction (on the last stage)
        parallelize_module(module.block, tp_mesh, _block_plan(module.block, sp))
        plan = _mtp_plan(sp)
        if "" in plan:
            parallelize_module(module, tp_mesh, plan.pop(""))
        parallelize_module(module, tp_mesh, plan)
    if tied:  # both are sharded along the vocabulary (dim 0): they stay one parameter
        model.output.weight = model.tok_embeddings.weight
