"""Everything that makes one model many, applied from outside in one fixed order."""

from __future__ import annotations

from torch import nn

from tessera.config import JobConfig
from tessera.dtypes import DTYPES
from tessera.model.blocks import block_containers
from tessera.parallel.activation import apply_activation_checkpointing, apply_compile, compile_enabled
from tessera.parallel.context import apply_context_parallel
from tessera.parallel.dims import ParallelDims
from tessera.parallel.expert import apply_expert_parallel, apply_global_batch_group
from tessera.parallel.fp8 import convert_float8, convert_mxfp8
from tessera.parallel.fsdp import apply_ddp, apply_fsdp
from tessera.parallel.qat import apply_qat
from tessera.parallel.grads import clip_grad_norm
from tessera.parallel.env import resolve_device
from tessera.parallel.tensor import apply_tensor_parallel

__all__ = ["ParallelDims", "clip_grad_norm", "parallelize"]


def parallelize(
    model: nn.Module, dims: ParallelDims, config: JobConfig, device_type: str = "", frozen: bool = False
) -> nn.Module:
    """Apply QAT/fp8 -> TP/SP -> EP -> CP -> activation checkpointing -> compile -> FSDP/HSDP/DDP to ``model``.

    ``dims.build_mesh`` must have run. Returns the model to train (the same module, or its
    DDP wrapper). ``device_type`` (default: ``train.device``, "auto" meaning CUDA when available) decides
    ``parallel.compile="auto"``. A ``frozen`` model (a distillation teacher) is never wrapped in DDP: it has no
    gradients to average (FSDP still shards it).
    """
    p = config.parallel
    fp8, device_type = config.train.fp8, device_type or resolve_device(config.train.device, require_visible=False).type
    t = config.train
    if t.qat != "none":  # first, like float8: a module swap before TP, compile and FSDP
        apply_qat(model, t.qat, t.qat_group_size, t.qat_start)
    if fp8 in ("tensorwise", "rowwise"):  # before TP: torchao's plans shard its Float8Linear
        convert_float8(model, fp8, device_type, fsdp_all_gather=uses_fsdp(dims) and device_type == "cuda")
    tp_mesh = dims.submesh("tp")
    if tp_mesh is not None:
        apply_tensor_parallel(model, tp_mesh, p.sequence_parallel)
    if fp8 == "mxfp8":  # after TP: the MXFP8 weight wrapper must sit on top of the DTensor
        convert_mxfp8(model, device_type)
    ep_mesh = dims.submesh("ep")
    if ep_mesh is not None:
        apply_expert_parallel(model, ep_mesh, tp_mesh)
    cp_mesh = dims.submesh("cp")
    if cp_mesh is not None:  # attention over the sequence split across the cp ranks (no parameters of its own)
        apply_context_parallel(model, cp_mesh, p.cp_method)
    batch_mesh = dims.submesh("dp_cp") or dims.submesh("dp")
    if batch_mesh is not None and batch_mesh.size() > 1:  # MoE's global scope: the whole global micro-batch
        apply_global_batch_group(model, batch_mesh)
    apply_activation_checkpointing(block_containers(model), p.activation_checkpoint, p.ac_every)
    if compile_enabled(p, device_type):
        apply_compile(block_containers(model))
    if p.engine == "deepspeed":  # deepspeed.initialize partitions it (tessera/parallel/deepspeed.py)
        return model
    if uses_fsdp(dims):
        mesh = dims.submesh("hsdp") or dims.submesh("fsdp")
        experts = (dims.submesh("ehsdp") or dims.submesh("efsdp"), dims.dp * dims.cp) if ep_mesh is not None else None
        apply_fsdp(model, mesh, DTYPES[config.train.dtype], p.reshard_after_forward, p.cpu_offload, experts)
    elif dims.dp_replicate > 1 and not frozen:
        model = apply_ddp(model, dims.submesh("dp"))
    return model


def uses_fsdp(dims: ParallelDims) -> bool:
    """Whether FSDP2 wraps the model (and then also handles mixed precision): when parameters are
    sharded, and for plain data parallelism beside TP or PP, where DDP cannot take DTensor
    parameters or per-micro-batch backward: FSDP2 on a (replicate, shard=1) mesh replicates."""
    return dims.dp_shard * dims.cp > 1 or (dims.dp_replicate > 1 and (dims.tp > 1 or dims.pp > 1))
