"""Pipeline parallelism: split a zoo model into stages and run them with torch.distributed.pipelining.

A model of ``n`` blocks becomes ``pp * v`` stages (``v`` virtual stages per rank for the
interleaved and zero-bubble schedules): the first holds the token embedding, the last the final
norm, head and loss, and the blocks are balanced by count or follow ``parallel.layers_per_stage``.
A stage model is the same module type as the full model with the other stages' modules removed,
and its blocks keep their ``layers`` keys, so its parameter names are the full model's. Each
stage is then parallelized like a whole model (TP/SP -> AC -> compile -> FSDP) on its pp slice
of the mesh. The rank's *local model* holds the union of its stages' modules (it is what the
optimizer, gradient clipping and DCP checkpoints see: full-model FQNs, so a checkpoint saved at
pp=2 loads at pp=1 and the other way round).

Loss semantics equal pp=1: the schedule's loss function returns each micro-batch's share of the
local-batch mean (token-weighted, divided by ``grad_accum``) and gradients are not rescaled by
the schedule. MoE auxiliary losses are attached to each stage's output with a gradient of
``1 / (grad_accum * microbatches)``: they are computed per micro-batch, exactly as a pp=1 run
with ``grad_accum * microbatches`` accumulation steps computes them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from torch.distributed.tensor import DTensor, Shard

from tessera.config import ConfigError, JobConfig, ParallelConfig
from tessera.model import Encoder, build_model
from tessera.model.moe import moe_layers

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "interleaved_zb": ScheduleInterleavedZeroBubble,
}
MULTI_STAGE = ("interleaved_1f1b", "interleaved_zb")

# (logits, labels, label_smoothing, loss_mask) -> mean loss over the masked positions
LossFn = Callable[[torch.Tensor, torch.Tensor, float, "torch.Tensor | None"], torch.Tensor]


def virtual_stages(p: ParallelConfig) -> int:
    """Stages per rank: ``parallel.pp_virtual_stages``, or 2 for the multi-stage schedules, else 1."""
    if p.pp_virtual_stages:
        return p.pp_virtual_stages
    return 2 if p.pp_schedule in MULTI_STAGE else 1


def microbatches(p: ParallelConfig) -> int:
    """Micro-batches per pipeline step: ``parallel.microbatches``, or ``pp`` when 0."""
    return p.microbatches or p.pp


def stage_layer_counts(n_layers: int, n_stages: int, layers_per_stage: str = "") -> list[int]:
    """Blocks per stage: the explicit comma-separated list, or ``n_layers`` balanced by count."""
    if layers_per_stage:
        return [int(c) for c in layers_per_stage.split(",")]
    return [n_layers // n_stages + (1 if i < n_layers % n_stages else 0) for i in range(n_stages)]


def local_stage_ids(rank: int, pp: int, v: int) -> list[int]:
    """The stage indices a pp rank runs, looped: ``rank + k*pp`` for each of its ``v`` stages."""
    return [rank + k * pp for k in range(v)]


def check_pipeline_plan(config: JobConfig, dp: int | None = None) -> None:
    """Raise a one-line ConfigError when the pipeline plan cannot run (``dp`` when known)."""
    p, m, t = config.parallel, config.model, config.train
    if p.pp == 1:
        return
    schedule, v, mb = p.pp_schedule, virtual_stages(p), microbatches(p)
    if m.arch == "encoder_decoder":
        raise ConfigError("parallel.pp > 1 splits decoder and encoder models; model.arch='encoder_decoder' is not supported, set parallel.pp=1")
    if config.data.document_mask:
        raise ConfigError("data.document_mask needs positions and document ids on every pipeline stage, which parallel.pp > 1 does not pass; set data.document_mask=false or parallel.pp=1")
    if schedule in MULTI_STAGE and v < 2:
        raise ConfigError(f"parallel.pp_schedule='{schedule}' needs several stages per rank; set parallel.pp_virtual_stages >= 2 (or 0 for the default 2)")
    if schedule not in MULTI_STAGE and v != 1:
        raise ConfigError(f"parallel.pp_schedule='{schedule}' runs one stage per rank; set parallel.pp_virtual_stages=1 or use interleaved_1f1b / interleaved_zb")
    n_stages = p.pp * v
    if p.layers_per_stage:
        counts = p.layers_per_stage.split(",")
        if not all(c.strip().isdigit() and int(c) >= 1 for c in counts):
            raise ConfigError(f"parallel.layers_per_stage={p.layers_per_stage!r} must be comma-separated positive block counts, e.g. '3,5'")
        if len(counts) != n_stages or sum(map(int, counts)) != m.n_layers:
            raise ConfigError(f"parallel.layers_per_stage={p.layers_per_stage!r} must list {n_stages} stages (pp * virtual stages) summing to model.n_layers={m.n_layers}")
    elif n_stages > m.n_layers:
        raise ConfigError(f"{n_stages} pipeline stages (pp={p.pp} x {v} per rank) but model.n_layers={m.n_layers}; every stage needs a block, lower parallel.pp or pp_virtual_stages")
    if schedule == "1f1b" and mb < p.pp:
        raise ConfigError(f"parallel.pp_schedule='1f1b' needs microbatches >= pp, got parallel.microbatches={mb} with pp={p.pp}")
    if schedule in MULTI_STAGE and mb % p.pp:
        raise ConfigError(f"parallel.pp_schedule='{schedule}' needs parallel.microbatches to be a multiple of pp={p.pp}, got {mb}")
    if schedule == "interleaved_zb" and p.compile:
        raise ConfigError(f"parallel.pp_schedule='{schedule}' splits the backward into input and weight parts, which torch.compile does not support; use 1f1b or interleaved_1f1b")
    if dp is not None and t.batch_size % (dp * mb):
        raise ConfigError(f"train.batch_size={t.batch_size} is not divisible by dp={dp} x parallel.microbatches={mb}; make it a multiple of {dp * mb}")


class _AttachAux(torch.autograd.Function):
    """Identity on ``h`` whose backward also sends gradient ``scale`` into ``aux`` (MoE losses)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


class _StageForward:
    """Forward of a stage model: embed (first), its blocks, norm + head (last), MoE losses attached."""

    pp_first: bool
    pp_last: bool
    pp_sp_mesh: DeviceMesh | None
    pp_aux_scale: float
    pp_aux_log: list[float]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens (first stage) or hidden states -> hidden states, or logits on the last stage."""
        if self.pp_first:
            h = self.encode(x) if isinstance(self, Encoder) else self.run(self.tok_embeddings(x))
        else:
            if self.pp_sp_mesh is not None:  # sequence-parallel activations travel as local shards
                x = DTensor.from_local(x, self.pp_sp_mesh, (Shard(1),), run_check=False)
            h = self.run(x)
        layers = moe_layers(self)
        if layers and torch.is_grad_enabled():
            aux = sum(m.aux_coef * m.aux_loss + m.z_coef * m.z_loss for m in layers)
            self.pp_aux_log.append(float(aux.detach()) * self.pp_aux_scale)
            h = _AttachAux.apply(h, aux, self.pp_aux_scale)
        if not self.pp_last:
            return h.to_local() if isinstance(h, DTensor) else h
        if isinstance(self, Encoder):
            h = self.head(h)
        return self.output(h)


_STAGE_CLASSES: dict[type, type] = {}


def _stage_class(cls: type) -> type:
    if cls not in _STAGE_CLASSES:
        _STAGE_CLASSES[cls] = type(f"{cls.__name__}Stage", (_StageForward, cls), {})
    return _STAGE_CLASSES[cls]


def _part(full: nn.Module, config: JobConfig, keys: list[str], first: bool, last: bool) -> nn.Module:
    """A model of the same type holding ``full``'s modules for blocks ``keys`` (shared, not copied)."""
    with torch.device("meta"):
        part = build_model(config.model)
    for name, child in full.named_children():
        setattr(part, name, child)
    for name, buf in full.named_buffers(recurse=False):
        setattr(part, name, buf)
    part.layers = nn.ModuleDict({k: full.layers[k] for k in keys})
    if not first:
        for name in ("tok_embeddings", "type_embeddings", "pos_embeddings", "embed_norm"):
            if hasattr(part, name):
                setattr(part, name, None)
        part.embed_dropout = nn.Identity()
    if not last:
        for name in ("norm", "head", "output"):
            if hasattr(part, name):
                setattr(part, name, None)
    part.__class__ = _stage_class(type(full))
    part.pp_first, part.pp_last, part.pp_sp_mesh = first, last, None
    part.pp_aux_scale, part.pp_aux_log = 0.0, []
    return part


def split_model(full: nn.Module, config: JobConfig, stage_ids: list[int]) -> tuple[nn.Module, list[nn.Module]]:
    """(local model, stage models) of one pp rank; all share ``full``'s modules."""
    p = config.parallel
    n_stages = p.pp * virtual_stages(p)
    counts = stage_layer_counts(config.model.n_layers, n_stages, p.layers_per_stage)
    bounds = [sum(counts[:i]) for i in range(n_stages + 1)]
    keys = [[str(i) for i in range(bounds[s], bounds[s + 1])] for s in range(n_stages)]
    stages = [_part(full, config, keys[s], s == 0, s == n_stages - 1) for s in stage_ids]
    local_keys = sorted((k for s in stage_ids for k in keys[s]), key=int)
    local = _part(full, config, local_keys, 0 in stage_ids, n_stages - 1 in stage_ids)
    return local, stages


def _scalar(t: torch.Tensor) -> float:
    return float((t.full_tensor() if isinstance(t, DTensor) else t).detach())


@dataclass
class _Targets:
    """What the loss function needs for one pipeline step."""

    masked: bool
    denominator: float
    label_smoothing: float


class Pipeline:
    """The stages of one pp rank and their schedule; ``step`` trains, ``eval_loss`` evaluates."""

    def __init__(self, local: nn.Module, stages: list[nn.Module], stage_ids: list[int], n_stages: int, config: JobConfig, pp_mesh: DeviceMesh, device: torch.device, loss_fn: LossFn) -> None:
        p = config.parallel
        self.model = local
        self.stage_models = stages
        self.pp_group = pp_mesh.get_group()
        self.microbatches = microbatches(p)
        self.has_first = 0 in stage_ids
        self.has_last = n_stages - 1 in stage_ids
        self._loss_fn = loss_fn
        self._targets = _Targets(False, 1.0, 0.0)
        self.label_smoothing = config.train.label_smoothing
        pipe_stages = [PipelineStage(m, s, n_stages, device, group=self.pp_group) for m, s in zip(stages, stage_ids)]
        cls = SCHEDULES[p.pp_schedule]
        first = pipe_stages if p.pp_schedule in MULTI_STAGE else pipe_stages[0]
        self.schedule = cls(first, self.microbatches, loss_fn=self._loss, scale_grads=False)

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        labels, mask = (target[..., 0], target[..., 1].bool()) if self._targets.masked else (target, None)
        count = labels.numel() if mask is None else int(mask.sum())
        return self._loss_fn(output, labels, self._targets.label_smoothing, mask) * (count / self._targets.denominator)

    def _run(self, args: tuple[torch.Tensor, ...], labels: torch.Tensor, loss_mask: torch.Tensor | None, denominator: float, train: bool) -> float:
        self._targets = _Targets(loss_mask is not None, denominator, self.label_smoothing if train else 0.0)
        target = labels if loss_mask is None else torch.stack([labels, loss_mask.to(labels.dtype)], dim=-1)
        losses: list[torch.Tensor] = []
        inputs = args if self.has_first else ()
        kwargs = {"target": target, "losses": losses} if self.has_last else {}
        (self.schedule.step if train else self.schedule.eval)(*inputs, **kwargs)
        # The first step's shape inference runs one extra forward per stage: count the schedule's own.
        local = sum(_scalar(loss) for loss in losses) + sum(sum(m.pp_aux_log[-self.microbatches :]) for m in self.stage_models)
        total = torch.tensor([local], dtype=torch.float64, device=labels.device)
        dist.all_reduce(total, group=self.pp_group)
        return total.item()

    def step(self, args: tuple[torch.Tensor, ...], labels: torch.Tensor, loss_mask: torch.Tensor | None, grad_accum: int) -> float:
        """Forward and backward of one local batch through the pipeline; returns its loss / grad_accum.

        The number is the same on every pp rank (the last stage's losses plus every stage's
        MoE losses, summed over the pp group).
        """
        for m in self.stage_models:
            m.pp_aux_scale, m.pp_aux_log = 1.0 / (grad_accum * self.microbatches), []
        tokens = labels.numel() if loss_mask is None else int(loss_mask.sum())
        return self._run(args, labels, loss_mask, max(tokens, 1) * grad_accum, train=True)

    def eval_loss(self, args: tuple[torch.Tensor, ...], labels: torch.Tensor, loss_mask: torch.Tensor | None) -> float:
        """The summed (not averaged) token loss of a batch, forward only, on every pp rank."""
        if labels.shape[0] % self.microbatches:
            raise ConfigError(f"an evaluation batch of {labels.shape[0]} sequences per rank is not divisible by parallel.microbatches={self.microbatches}; raise train.eval_batches or the validation split")
        for m in self.stage_models:
            m.pp_aux_log = []
        return self._run(args, labels, loss_mask, 1.0, train=False)


def build_pipeline(
    model: nn.Module,
    dims,
    config: JobConfig,
    device: torch.device,
    loss_fn: LossFn,
    parallelize_stage: Callable[[nn.Module], nn.Module],
) -> Pipeline:
    """Split ``model`` for this rank's pp stages, parallelize each stage, and build the schedule.

    ``parallelize_stage`` applies TP/SP -> AC -> compile -> FSDP to one stage model.
    """
    p = config.parallel
    pp_mesh = dims.submesh("pp")
    v = virtual_stages(p)
    stage_ids = local_stage_ids(pp_mesh.get_local_rank(), p.pp, v)
    local, stages = split_model(model.to(device), config, stage_ids)
    sp_mesh = dims.submesh("tp") if p.tp > 1 and p.sequence_parallel else None
    parallel_stages = []
    for stage in stages:
        with warnings.catch_warnings():  # the TP plan names modules other stages hold
            warnings.filterwarnings("ignore", message="Parallelize plan key")
            stage = parallelize_stage(stage)
        stage.pp_sp_mesh = sp_mesh
        parallel_stages.append(stage)
    return Pipeline(local, parallel_stages, stage_ids, p.pp * v, config, pp_mesh, device, loss_fn)

