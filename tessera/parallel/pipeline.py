"""Pipeline parallelism: split a zoo model into stages and run them with torch.distributed.pipelining.

A model of ``n`` blocks becomes ``pp * v`` stages (``v`` virtual stages per rank for the
interleaved and zero-bubble schedules): the first holds the token embedding, the last the final
norm, head and loss, and the blocks are balanced by count or follow ``parallel.layers_per_stage``.
A stage *is* the model: the same class, sharing the full model's modules, with the other stages'
parts set to None (the zoo's forwards accept hidden states without an embedding and return them
without a head), and its blocks keep their ``layers`` keys, so its parameter names are the full
model's. Each stage is then parallelized like a whole model (TP/SP -> AC -> compile -> FSDP) on
its pp slice of the mesh; what only a pipeline needs (sequence-parallel activations crossing the
stage boundary, MoE losses) is added from outside by forward hooks (:class:`StageHooks`). The
rank's *local model* holds the union of its stages' modules (it is what the optimizer, gradient
clipping and DCP checkpoints see: full-model FQNs, so a checkpoint saved at pp=2 loads at pp=1).

Loss semantics equal pp=1: the schedule's loss function returns each micro-batch's share of the
local-batch mean (token-weighted, divided by ``grad_accum``) and gradients are not rescaled by
the schedule. MoE auxiliary losses are attached to each stage's output with a gradient of
``1 / (grad_accum * microbatches)``: they are computed per micro-batch, exactly as a pp=1 run
with ``grad_accum * microbatches`` accumulation steps computes them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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

from tessera.config import ConfigError, JobConfig
from tessera.layout import MULTI_STAGE_SCHEDULES, local_stage_ids, microbatches, stage_layer_counts, virtual_stages
from tessera.model import MoELog, build_model, moe_loss
from tessera.parallel.shared import (
    SharedParameter,
    find_shared,
    make_groups,
    norm_duplicates,
    reduce_shared_grads,
    tie_local_uses,
)

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "interleaved_zb": ScheduleInterleavedZeroBubble,
}

# (logits, labels, label_smoothing, loss_mask) -> mean loss over the masked positions
LossFn = Callable[[torch.Tensor, torch.Tensor, float, "torch.Tensor | None"], torch.Tensor]

_DOCUMENT_KEYS = ("positions", "document_ids")  # what a document mask needs on every stage
_FIRST_STAGE_PARTS = ("tok_embeddings", "type_embeddings", "pos_embeddings", "embed_norm", "embed_dropout")
_LAST_STAGE_PARTS = ("norm", "head", "output")


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


@dataclass
class StageHooks:
    """What a pipeline adds around one stage model's forward, as hooks from outside.

    Before: a stage after the first receives sequence-parallel activations as local shards and
    re-wraps them as DTensors; with document masks it also receives the micro-batch's positions
    and document ids (the first stage gets them as keyword arguments from the schedule) and hands
    them to the model. After: the MoE losses of the forward are attached to the output (with
    gradient ``aux_scale``) and recorded for the reported loss; hidden states leave the stage as
    plain tensors, followed by the positions and document ids for the next stage.
    """

    first: bool
    last: bool
    max_len: int  # model.max_seq_len: the position tables' length
    sp_mesh: DeviceMesh | None = None
    aux_scale: float = 0.0  # the MoE losses' weight in the step's loss: 1 / (grad_accum * micro-batches)
    grad_scale: float = 1.0  # the fp16 loss scale, applied to their gradient like to the main loss's
    aux_losses: list[torch.Tensor] = field(default_factory=list)  # this step's weighted MoE losses (detached)
    logs: list[MoELog] = field(default_factory=list)  # this step's training forwards' MoE stats
    _log: MoELog = field(default_factory=MoELog)
    _extras: tuple[torch.Tensor, ...] = ()  # (positions, document_ids) of the micro-batch in flight

    def install(self, stage: nn.Module) -> None:
        """Register the hooks on ``stage`` (after it is parallelized)."""
        stage.register_forward_pre_hook(self._before, with_kwargs=True)
        stage.register_forward_hook(self._after)

    def _before(self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]):
        x = args[0]
        if self.first:
            extras = tuple(kwargs[k] for k in _DOCUMENT_KEYS if kwargs.get(k) is not None)
        else:
            extras = args[1:]
            if extras:  # torch's shape inference runs a stage on uninitialized buffers: keep positions valid
                extras = (extras[0].clamp(0, self.max_len - 1), *extras[1:])
            kwargs = {**kwargs, **dict(zip(_DOCUMENT_KEYS, extras))}
            if self.sp_mesh is not None:
                x = DTensor.from_local(x, self.sp_mesh, (Shard(1),), run_check=False)
        self._log, self._extras = MoELog(), extras
        return (x,), {**kwargs, "moe_log": self._log}

    def _after(self, _module: nn.Module, _args: tuple[Any, ...], out: torch.Tensor) -> Any:
        log, self._log = self._log, MoELog()
        aux = moe_loss(log)
        if not self.last and isinstance(out, DTensor):
            out = out.to_local()
        if aux is not None and torch.is_grad_enabled():
            self.logs.append(log)
            self.aux_losses.append(aux.detach() * self.aux_scale)
            out = _AttachAux.apply(out, aux, self.aux_scale * self.grad_scale)
        return (out, *self._extras) if self._extras and not self.last else out


def stage_model(
    full: nn.Module, config: JobConfig, keys: list[str], first: bool, last: bool, keep: frozenset[str] = frozenset()
) -> nn.Module:
    """A model of ``full``'s class holding its modules for blocks ``keys`` (shared, not copied);
    the embedding parts only on the first stage, the final norm and head only on the last (or
    where ``keep`` names them)."""
    with torch.device("meta"):
        part = build_model(config.model)
    for name, child in full.named_children():
        setattr(part, name, child)
    for name, buf in full.named_buffers(recurse=False):
        setattr(part, name, buf)
    part.layers = nn.ModuleDict({k: full.layers[k] for k in keys})
    absent = (_FIRST_STAGE_PARTS if not first else ()) + (_LAST_STAGE_PARTS if not last else ())
    for name in absent:
        if hasattr(part, name) and name not in keep:
            setattr(part, name, None)
    return part


def _stage_keys(config: JobConfig) -> list[list[str]]:
    """The block keys of every stage."""
    p = config.parallel
    n_stages = p.pp * virtual_stages(p)
    counts = stage_layer_counts(config.model.n_layers, n_stages, p.layers_per_stage)
    bounds = [sum(counts[:i]) for i in range(n_stages + 1)]
    return [[str(i) for i in range(bounds[s], bounds[s + 1])] for s in range(n_stages)]


def split_model(
    full: nn.Module, config: JobConfig, stage_ids: list[int]
) -> tuple[nn.Module, list[nn.Module], list[SharedParameter]]:
    """(local model, stage models, parameters shared across pp ranks) of one pp rank; all share
    ``full``'s modules. The local model also holds the other uses of this rank's shared
    parameters (a tied head beside the embedding), so its names are the unsplit model's."""
    keys = _stage_keys(config)
    n = len(keys)
    every = {s: stage_model(full, config, keys[s], s == 0, s == n - 1) for s in range(n)}
    shared = find_shared(every, config.parallel.pp)
    rank = stage_ids[0] % config.parallel.pp
    children = {id(child): name for name, child in full.named_children()}
    keep = frozenset(children[id(m)] for sp in shared if rank in sp.ranks for m, _ in sp.uses if id(m) in children)
    local_keys = sorted((k for s in stage_ids for k in keys[s]), key=int)
    local = stage_model(full, config, local_keys, 0 in stage_ids, n - 1 in stage_ids, keep)
    return local, [every[s] for s in stage_ids], shared


def _scalar(t: torch.Tensor) -> float:
    return float((t.full_tensor() if isinstance(t, DTensor) else t).detach())


@dataclass
class _Targets:
    """What the loss function needs for one pipeline step."""

    masked: bool
    denominator: float
    label_smoothing: float
    scale: float = 1.0  # the fp16 loss scale (1 otherwise)


class Pipeline:
    """The stages of one pp rank and their schedule; ``step`` trains, ``eval_loss`` evaluates."""

    def __init__(
        self,
        local: nn.Module,
        stages: list[tuple[int, nn.Module, StageHooks]],
        n_stages: int,
        config: JobConfig,
        pp_mesh: DeviceMesh,
        device: torch.device,
        loss_fn: LossFn,
    ) -> None:
        p = config.parallel
        stage_ids = [s for s, _, _ in stages]
        self.model = local
        self.shared: list[SharedParameter] = []  # used by stages on several pp ranks (tied embeddings)
        self.pp_rank = pp_mesh.get_local_rank()
        self.stage_models = [m for _, m, _ in stages]
        self.hooks = [h for _, _, h in stages]
        self.pp_group = pp_mesh.get_group()
        self.microbatches = microbatches(p)
        self.has_first = 0 in stage_ids
        self.has_last = n_stages - 1 in stage_ids
        self._loss_fn = loss_fn
        self._targets = _Targets(False, 1.0, 0.0)
        self.label_smoothing = config.train.label_smoothing
        pipe_stages = [PipelineStage(m, s, n_stages, device, group=self.pp_group) for s, m, _ in stages]
        cls = SCHEDULES[p.pp_schedule]
        first = pipe_stages if p.pp_schedule in MULTI_STAGE_SCHEDULES else pipe_stages[0]
        self.schedule = cls(first, self.microbatches, loss_fn=self._loss, scale_grads=False)

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        labels, mask = (target[..., 0], target[..., 1].bool()) if self._targets.masked else (target, None)
        count = labels.numel() if mask is None else int(mask.sum())
        loss = self._loss_fn(output, labels, self._targets.label_smoothing, mask)
        return loss * (count / self._targets.denominator * self._targets.scale)

    def _run(
        self,
        args: tuple[torch.Tensor, ...],
        labels: torch.Tensor,
        loss_mask: torch.Tensor | None,
        denominator: float,
        train: bool,
        model_kwargs: dict[str, torch.Tensor] | None = None,
        loss_scale: float = 1.0,
    ) -> float:
        smoothing = self.label_smoothing if train else 0.0
        self._targets = _Targets(loss_mask is not None, denominator, smoothing, loss_scale)
        target = labels if loss_mask is None else torch.stack([labels, loss_mask.to(labels.dtype)], dim=-1)
        losses: list[torch.Tensor] = []
        for hooks in self.hooks:
            hooks.aux_losses, hooks.logs = [], []
        inputs = args if self.has_first else ()
        kwargs = {"target": target, "losses": losses} if self.has_last else {}
        if self.has_first:  # split into micro-batches by the schedule, like the inputs
            kwargs.update(model_kwargs or {})
        if train:  # the micro-batches' outputs are not kept: each one's logits die with its backward
            self.schedule.step(*inputs, return_outputs=False, **kwargs)
        else:
            self.schedule.eval(*inputs, **kwargs)
        # The first step's shape inference runs one extra forward per stage: count the schedule's own.
        aux = [a for hooks in self.hooks for a in hooks.aux_losses[-self.microbatches :]]
        local = sum(_scalar(loss) for loss in losses) / self._targets.scale + sum(float(a) for a in aux)
        total = torch.tensor([local], dtype=torch.float64, device=labels.device)
        dist.all_reduce(total, group=self.pp_group)
        return total.item()

    def moe_logs(self) -> list[MoELog]:
        """The MoE stats of the last step's training forwards on this rank's stages."""
        return [log for hooks in self.hooks for log in hooks.logs[-self.microbatches :]]

    def step(
        self,
        args: tuple[torch.Tensor, ...],
        labels: torch.Tensor,
        loss_mask: torch.Tensor | None,
        grad_accum: int,
        model_kwargs: dict[str, torch.Tensor] | None = None,
        loss_scale: float = 1.0,
    ) -> float:
        """Forward and backward of one local batch through the pipeline; returns its loss / grad_accum.

        The number is the same on every pp rank (the last stage's losses plus every stage's
        MoE losses, summed over the pp group). ``loss_scale`` (fp16) multiplies every gradient,
        as the grad scaler's ``scale(loss)`` does outside a pipeline; the returned loss is unscaled.
        """
        for hooks in self.hooks:
            hooks.aux_scale, hooks.grad_scale = 1.0 / (grad_accum * self.microbatches), loss_scale
        tokens = labels.numel() if loss_mask is None else int(loss_mask.sum())
        return self._run(args, labels, loss_mask, max(tokens, 1) * grad_accum, True, model_kwargs, loss_scale)

    def reduce_shared_grads(self) -> None:
        """Sum the gradients of parameters used on several pp ranks (before clipping and stepping)."""
        reduce_shared_grads(self.shared)

    def norm_duplicates(self) -> list[torch.Tensor]:
        """Copies of shared parameters this rank leaves out of the global gradient norm."""
        return norm_duplicates(self.shared, self.pp_rank)

    def eval_loss(
        self,
        args: tuple[torch.Tensor, ...],
        labels: torch.Tensor,
        loss_mask: torch.Tensor | None,
        model_kwargs: dict[str, torch.Tensor] | None = None,
    ) -> float:
        """The summed (not averaged) token loss of a batch, forward only, on every pp rank."""
        if labels.shape[0] % self.microbatches:
            raise ConfigError(
                f"an evaluation batch of {labels.shape[0]} sequences per rank is not divisible by "
                f"parallel.microbatches={self.microbatches}; raise train.eval_batches or the validation split"
            )
        return self._run(args, labels, loss_mask, 1.0, False, model_kwargs)


def build_pipeline(
    model: nn.Module,
    dims: Any,
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
    n_stages = p.pp * v
    stage_ids = local_stage_ids(pp_mesh.get_local_rank(), p.pp, v)
    on_meta = any(p.is_meta for p in model.parameters())  # meta init: materialized after sharding
    local, stage_models, shared = split_model(model if on_meta else model.to(device), config, stage_ids)
    sp_mesh = dims.submesh("tp") if p.tp > 1 and p.sequence_parallel else None
    stages = []
    for stage_id, stage in zip(stage_ids, stage_models):
        with warnings.catch_warnings():  # the TP plan names modules other stages hold
            warnings.filterwarnings("ignore", message="Parallelize plan key")
            stage = parallelize_stage(stage)
        hooks = StageHooks(stage_id == 0, stage_id == n_stages - 1, config.model.max_seq_len, sp_mesh)
        hooks.install(stage)
        stages.append((stage_id, stage, hooks))
    tie_local_uses(shared, local)
    make_groups(shared, dims.mesh, pp_mesh.get_group())
    pipeline = Pipeline(local, stages, n_stages, config, pp_mesh, device, loss_fn)
    pipeline.shared = shared
    return pipeline
