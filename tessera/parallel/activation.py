"""Activation checkpointing of transformer blocks (full, every n-th block, or op-level selective), and
regional torch.compile of the blocks (``parallel.compile``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._inductor.runtime.cache_dir_utils import default_cache_dir
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# Op-level selective checkpointing keeps these outputs and recomputes the cheap rest.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _op_selective_context():
    return create_selective_checkpoint_contexts(_save_matmuls)


def apply_activation_checkpointing(stacks: list[nn.ModuleDict], mode: str, every: int = 1) -> None:
    """Wrap blocks in place: "full" all, "selective" every ``every``-th, "op" all with a save-matmuls policy."""
    if mode == "none":
        return
    for layers in stacks:
        _checkpoint_stack(layers, mode, every)


def _checkpoint_stack(layers: nn.ModuleDict, mode: str, every: int) -> None:
    for i, (name, block) in enumerate(list(layers.items())):
        if mode == "selective" and i % every:
            continue
        if mode == "op":
            wrapped = checkpoint_wrapper(block, context_fn=_op_selective_context, preserve_rng_state=True)
        else:
            wrapped = checkpoint_wrapper(block, preserve_rng_state=True)
        layers[name] = wrapped


def compile_enabled(p: Any, device_type: str) -> bool:
    """Whether ``parallel.compile`` compiles the blocks: true/false as given; "auto" on CUDA, except where
    compile is refused (the DeepSpeed engine, the zero-bubble pipeline schedule). On CPU "auto" is off:
    benchmarks/throughput.py measured 1.3% faster steps for 18-24 s of compiling (README, Performance)."""
    if isinstance(p.compile, bool):
        return p.compile
    refused = p.engine == "deepspeed" or (p.pp > 1 and p.pp_schedule in ("interleaved_zb", "zbv", "dualpipev"))
    return device_type == "cuda" and not refused


def use_inductor_cache(directory: Path | None = None) -> str:
    """Point TorchInductor's cache (compiled kernels, FX and AOT-autograd graphs) at ``directory``, default
    ~/.cache/tessera/inductor, unless $TORCHINDUCTOR_CACHE_DIR chose another place than torch's default, which
    lives in the temp directory that reboots and cleaners empty. A restart then compiles from the cache."""
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")  # importing torch._dynamo already set it to the default
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory or Path.home() / ".cache" / "tessera" / "inductor")
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def apply_compile(stacks: list[nn.ModuleDict]) -> None:
    """``torch.compile`` each block (regional compilation: one graph reused by every block)."""
    for layers in stacks:
        for name, block in list(layers.items()):
            compiled = torch.compile(block, fullgraph=False)
            compiled.register_forward_pre_hook(_settle_async_inputs)
            layers[name] = compiled


def _settle_async_inputs(_module: nn.Module, args: tuple) -> tuple:
    """Tensor inputs of a compiled block as ordinary tensors.

    A tensor-parallel collective outside the block (the vocab-parallel embedding's all-reduce or
    reduce-scatter) returns an AsyncCollectiveTensor, possibly inside a DTensor; AOT autograd
    cannot differentiate a compiled region through that input (its backward receives a plain
    gradient where a DTensor is due, or a plain tensor where it traced an asynchronous one). A
    differentiable copy waits for the collective first (views of it would stay asynchronous).
    """
    return tuple(_settled(a) for a in args)


def _settled(arg: object) -> object:
    local = arg._local_tensor if isinstance(arg, DTensor) else arg  # DTensor keeps no public handle
    return arg.clone() if isinstance(local, AsyncCollectiveTensor) else arg
