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
    ScheduleDualPipeV,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
    _Action,
    _ComputationType,
    _PipelineScheduleRuntime,
)
from torch.distributed.pipelining import schedules
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
from torch.distributed.tensor import DTensor, Shard

from tessera.config import ConfigError, JobConfig
from tessera.layout import (
    MULTI_STAGE_SCHEDULES,
    SPLIT_BACKWARD_SCHEDULES,
    V_SCHEDULES,
    local_stage_ids,
    microbatches,
    pipeline_blocks,
    stage_layer_counts,
    virtual_stages,
)
from tessera.model import MoELog, build_model, moe_loss
from tessera.model.mtp import MTPLog, mtp_losses, mtp_token_counts
from tessera.model.transformer import OutputFn
from tessera.plan.stages import stage_split
from tessera.parallel.loss import LossWeights, MicroBatch, combine_losses, moe_aux_weight
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
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}

# (logits, labels, label_smoothing, loss_mask) -> mean loss over the masked positions
LossFn = Callable[[torch.Tensor, torch.Tensor, float, "torch.Tensor | None"], torch.Tensor]
# (labels, loss_mask, label_smoothing, backward_twice) -> the model's ``output_fn``: the head fused into
# the same mean loss; ``backward_twice``: the schedule splits backward into input and weight passes
HeadLoss = Callable[[torch.Tensor, "torch.Tensor | None", float, bool], OutputFn]

_DOCUMENT_KEYS = ("positions", "document_ids")  # what a document mask needs on every stage
_TARGETS = "targets"  # the first stage's keyword for the fused loss's (B, T, 2) labels and loss mask
_IGNORE = -100  # a label that gets no loss (F.cross_entropy's ignore index)
_FIRST_STAGE_PARTS = ("tok_embeddings", "type_embeddings", "pos_embeddings", "embed_norm", "embed_dropout")
_LAST_STAGE_PARTS = ("norm", "head", "output", "mtp")


class _AttachAux(torch.autograd.Function):
    """Identity on ``h`` whose backward also sends gradient ``scale`` into ``aux`` (MoE losses)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return h.clone()  # not a view: the zero-bubble schedules' split backward detaches stage outputs in place

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


@dataclass
class StageTail:
    """A micro-batch's metadata travelling after the hidden states from stage to stage (torch's pipelining
    sends a stage's outputs as positional tensors): its positions and document ids (document masks), the
    fused loss's targets, MTP's embedded tokens. Which of them travel is fixed for the whole run."""

    documents: tuple[torch.Tensor, ...] = ()  # (positions, document_ids) when the batch has document masks
    targets: torch.Tensor | None = None  # (B, T, 2) labels and loss mask for the last stage's fused loss
    embedded: torch.Tensor | None = None  # the embedded input tokens for the last stage's MTP modules

    def pack(self) -> tuple[torch.Tensor, ...]:
        """The tensors sent after the hidden states, in the order :meth:`unpack` reads them."""
        embedded = () if self.embedded is None else (self.embedded.view_as(self.embedded),)
        metadata = self.documents + (() if self.targets is None else (self.targets,))
        # The schedule's micro-batch chunks are views, which a split backward's in-place detach_ refuses.
        return tuple(t.clone() if t._is_view() else t for t in metadata) + embedded

    @classmethod
    def unpack(cls, tail: tuple[torch.Tensor, ...], targets: bool, embedded: bool) -> StageTail:
        """The metadata received after the hidden states (``targets``, ``embedded``: whether they travel)."""
        rest = list(tail)
        kept = rest.pop() if embedded else None
        wanted = rest.pop() if targets else None
        return cls(tuple(rest), wanted, kept)


@dataclass
class StageHooks:
    """What a pipeline adds around one stage model's forward, as hooks from outside.

    Before: a stage after the first receives sequence-parallel activations as local shards and
    re-wraps them as DTensors; with document masks it also receives the micro-batch's positions
    and document ids (the first stage gets them as keyword arguments from the schedule) and hands
    them to the model. After: the MoE losses of the forward are attached to the output (with
    gradient ``aux_scale``) and recorded for the reported loss; hidden states leave the stage as
    plain tensors, followed by the positions and document ids for the next stage.

    An encoder-decoder (``vocab_size`` set) carries its own tensors: every stage passes its inputs
    to the model as they come and sends on what the model returns (hidden states or the memory,
    and the decoder's token ids or hidden states, see ``EncoderDecoder.stage_forward``).

    Multi-token prediction (``mtp``): its modules live on the last stage and read the embedded
    input tokens, which only the first stage can make. The first stage sends its embedding
    output along (whole, not sequence-sharded) after the other tensors, every stage passes it on
    (its gradient flows back the same way to the embedding), and the last stage hands it to the
    model in an :class:`~tessera.model.mtp.MTPLog` and returns the MTP logits after its own when
    ``mtp_active`` (training) for the loss function.

    The fused head and loss (``head_loss``): the first stage takes the micro-batch's targets (labels
    and loss mask, one integer tensor) from its keyword arguments, every stage sends them on after
    the document metadata, and the last stage hands the model ``head_loss(...)`` as its
    ``output_fn``, so it returns the micro-batch's mean loss instead of its logits.
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
    _tail: StageTail = field(default_factory=StageTail)  # the metadata of the micro-batch in flight
    vocab_size: int = 0  # an encoder-decoder's: its stages carry token ids and the memory themselves
    mtp: bool = False  # the model has multi-token-prediction modules (on the last stage)
    mtp_active: bool = True  # the last stage runs them (training), else returns the main logits only
    _mtp_log: MTPLog | None = None
    head_loss: HeadLoss | None = None  # the fused head and loss on the last stage (not for an encoder-decoder)
    vocab: int = 0  # the labels' bound, to keep shape inference's uninitialized targets valid
    label_smoothing: float = 0.0  # this run's (0 in evaluation), for ``head_loss``
    masked: bool = False  # this run's targets carry a loss mask
    split_backward: bool = False  # the schedule runs backward in two passes (input, then weight gradients)

    def install(self, stage: nn.Module) -> None:
        """Register the hooks on ``stage`` (after it is parallelized)."""
        stage.register_forward_pre_hook(self._before, with_kwargs=True)
        stage.register_forward_hook(self._after)
        if self.mtp and self.first:
            stage.tok_embeddings.register_forward_hook(self._keep_embeddings)

    def _keep_embeddings(self, _module: nn.Module, _args: tuple[Any, ...], out: torch.Tensor) -> None:
        self._tail.embedded = out.full_tensor() if isinstance(out, DTensor) else out

    def _before(self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]):
        if self.vocab_size:
            self._log = MoELog()
            return tuple(self._received(a) for a in args) if not self.first else args, {**kwargs, "moe_log": self._log}
        x = args[0]
        targets = kwargs.get(_TARGETS)  # multi-stage schedules may hand every stage the first one's kwargs
        kwargs = {k: v for k, v in kwargs.items() if k != _TARGETS}
        if self.first:
            documents = tuple(kwargs[k] for k in _DOCUMENT_KEYS if kwargs.get(k) is not None)
            self._tail = StageTail(documents, targets if self.head_loss is not None else None)
        else:
            self._tail = self._received_tail(args[1:])
            kwargs = {**kwargs, **dict(zip(_DOCUMENT_KEYS, self._tail.documents))}
            if self.sp_mesh is not None:
                x = DTensor.from_local(x, self.sp_mesh, (Shard(1),), run_check=False)
        self._log = MoELog()
        if self.mtp and self.last and self.mtp_active:
            self._mtp_log = MTPLog(embeddings=self._tail.embedded)
            kwargs = {**kwargs, "mtp": self._mtp_log}
        if self.last and self.head_loss is not None:
            targets = self._tail.targets
            mask = targets[..., 1].bool() if self.masked else None
            output_fn = self.head_loss(targets[..., 0], mask, self.label_smoothing, self.split_backward)
            kwargs = {**kwargs, "output_fn": output_fn}
        return (x,), {**kwargs, "moe_log": self._log}

    def _received_tail(self, tail: tuple[torch.Tensor, ...]) -> StageTail:
        """The metadata after a later stage's hidden states; torch's shape inference runs a stage on
        uninitialized buffers, so positions and labels are kept valid."""
        received = StageTail.unpack(tail, self.head_loss is not None, self.mtp)
        if received.targets is not None:
            received.targets = _valid_targets(received.targets, self.vocab)
        if received.documents:
            positions, *rest = received.documents
            received.documents = (positions.clamp(0, self.max_len - 1), *rest)
        return received

    def _received(self, x: torch.Tensor) -> torch.Tensor:
        """An encoder-decoder stage's input from the previous stage, as its model reads it."""
        if not x.is_floating_point():  # torch's shape inference runs a stage on uninitialized buffers
            return x.clamp(0, self.vocab_size - 1)
        return DTensor.from_local(x, self.sp_mesh, (Shard(1),), run_check=False) if self.sp_mesh is not None else x

    def _after(self, _module: nn.Module, _args: tuple[Any, ...], out: Any) -> Any:
        if self.vocab_size and not self.last:  # (hidden states or memory, decoder token ids or hidden states)
            out = tuple(t.to_local() if isinstance(t, DTensor) else t for t in out)
            hidden = len(out) - 1 if out[-1].is_floating_point() else 0
            return (*out[:hidden], self._with_aux(out[hidden]), *out[hidden + 1 :])
        if not self.last and isinstance(out, DTensor):
            out = out.to_local()
        out = self._with_aux(out)
        if self.last:
            self._tail.targets = None
            if self.head_loss is not None:  # the loss, as a 1-vector: the schedule concatenates outputs
                out = out.reshape(1)
            return self._with_mtp_logits(out)
        passed, self._tail = self._tail.pack(), StageTail()
        return (out, *passed) if passed else out

    def _with_aux(self, out: torch.Tensor) -> torch.Tensor:
        """``out`` with the forward's MoE losses attached (recorded when training)."""
        log, self._log = self._log, MoELog()
        aux = moe_loss(log)
        if aux is not None and torch.is_grad_enabled():
            self.logs.append(log)
            self.aux_losses.append(aux.detach() * self.aux_scale)
            out = _AttachAux.apply(out, aux, self.aux_scale * self.grad_scale)
        return out

    def _with_mtp_logits(self, out: torch.Tensor) -> Any:
        """The last stage's logits, followed by each MTP depth's when they ran."""
        log, self._mtp_log, self._tail.embedded = self._mtp_log, None, None
        return (out, *log.logits) if log is not None and log.logits else out


class _VForward(_PipelineScheduleRuntime):
    """Forward only, over stages placed in a V (rank r: stages r and 2 pp - 1 - r): every micro-batch through
    a rank's first stage, then through its second."""

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable) -> None:
        super().__init__(stages=stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
        pp = stages[0].group_size
        self.stage_index_to_group_rank = generate_stage_to_rank_mapping(pp, self._num_stages, style="v")
        for stage in self._stages:
            stage.stage_index_to_group_rank = self.stage_index_to_group_rank
        forward = _ComputationType.FORWARD
        self.pipeline_order = {
            rank: [_Action(s, forward, mb) for s in (rank, 2 * pp - 1 - rank) for mb in range(n_microbatches)]
            for rank in range(pp)
        }
        # torch's schedule check requires every micro-batch's backward, which evaluation has not: lower the
        # actions to communication with the check answering the V placement instead.
        check, schedules._validate_schedule = schedules._validate_schedule, lambda *_: self.stage_index_to_group_rank
        try:
            self._prepare_schedule_with_comms(self.pipeline_order)
        finally:
            schedules._validate_schedule = check


def _valid_targets(targets: torch.Tensor, vocab: int) -> torch.Tensor:
    """``targets`` (labels, loss mask) unchanged where valid; torch's shape inference sends a stage
    uninitialized buffers, whose labels must still index the vocabulary."""
    labels, mask = targets[..., 0], targets[..., 1]
    labels = torch.where(labels < 0, _IGNORE, labels.clamp(max=vocab - 1))
    return torch.stack([labels, mask.clamp(0, 1)], dim=-1)


def stage_model(
    full: nn.Module, config: JobConfig, keys: list[str], first: bool, last: bool, keep: frozenset[str] = frozenset()
) -> nn.Module:
    """A model of ``full``'s class holding its modules for blocks ``keys`` (shared, not copied);
    the embedding parts only on the first stage, the final norm and head only on the last (or
    where ``keep`` names them). An encoder-decoder's keys count the encoder's blocks, then the decoder's."""
    with torch.device("meta"):
        part = build_model(config.model)
    stacks = {name: getattr(part, name) for name in ("encoder", "decoder") if hasattr(part, name)}
    for name, child in full.named_children():
        setattr(part, name, child)
    for name, buf in full.named_buffers(recurse=False):
        setattr(part, name, buf)
    if config.model.arch == "encoder_decoder":
        return _encoder_decoder_stage(full, part, stacks, config.model.n_layers, keys, keep)
    part.layers = nn.ModuleDict({k: full.layers[k] for k in keys})
    absent = (_FIRST_STAGE_PARTS if not first else ()) + (_LAST_STAGE_PARTS if not last else ())
    for name in absent:
        if hasattr(part, name) and name not in keep:
            setattr(part, name, None)
    return part


def _encoder_decoder_stage(
    full: nn.Module,
    part: nn.Module,
    stacks: dict[str, nn.Module],
    n_encoder: int,
    keys: list[str],
    keep: frozenset[str],
) -> nn.Module:
    """``part`` (holding ``full``'s children; ``stacks``: its own encoder and decoder, built on meta)
    as the stage of ``full`` running blocks ``keys``: its encoder and decoder hold only their blocks
    of the stage (None without any), each stack's embedding parts where its first block is and its
    final norm where its last is; the shared token embedding wherever a stack starts, the head
    with the decoder's last block."""
    blocks = [int(k) for k in keys]
    encoder = [str(i) for i in blocks if i < n_encoder]
    decoder = [str(i - n_encoder) for i in blocks if i >= n_encoder]
    part.encoder = _stack_part(full.encoder, stacks["encoder"], encoder)
    part.decoder = _stack_part(full.decoder, stacks["decoder"], decoder)
    starts = "0" in encoder or "0" in decoder
    ends = str(len(full.decoder.layers) - 1) in decoder
    if not starts and "tok_embeddings" not in keep:
        part.tok_embeddings = None
    if not ends and "output" not in keep:
        part.output = None
    return part


def _stack_part(full: nn.Module, part: nn.Module, keys: list[str]) -> nn.Module | None:
    """``part`` (built on meta) holding ``full``'s modules for blocks ``keys``, or None without any."""
    if not keys:
        return None
    for name, child in full.named_children():
        setattr(part, name, child)
    for name, buf in full.named_buffers(recurse=False):
        setattr(part, name, buf)
    part.layers = nn.ModuleDict({k: full.layers[k] for k in keys})
    if "0" not in keys:
        for name in ("pos_embeddings", "embed_norm", "embed_dropout"):
            setattr(part, name, None)
    if str(len(full.layers) - 1) not in keys:
        part.norm = None
    return part


def _stage_keys(config: JobConfig) -> list[list[str]]:
    """The block keys of every stage (an encoder-decoder's count the encoder's blocks, then the decoder's)."""
    p = config.parallel
    n_stages = p.pp * virtual_stages(p)
    counts = stage_layer_counts(pipeline_blocks(config.model), n_stages, stage_split(config))
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
    shared = find_shared(every, config.parallel.pp, config.parallel.pp_schedule)
    rank = stage_ids[0] % config.parallel.pp
    children = {id(child): name for name, child in full.named_children()}
    keep = frozenset(children[id(m)] for sp in shared if rank in sp.ranks for m, _ in sp.uses if id(m) in children)
    local_keys = sorted((k for s in stage_ids for k in keys[s]), key=int)
    local = stage_model(full, config, local_keys, 0 in stage_ids, n - 1 in stage_ids, keep)
    return local, [every[s] for s in stage_ids], shared


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().double()


def _with_rows(target: torch.Tensor) -> torch.Tensor:
    """``target`` (B, T) or (B, T, k) with a last column holding each sequence's row index (B, T, k + 1)."""
    base = target if target.dim() == 3 else target.unsqueeze(-1)
    rows = torch.arange(base.shape[0], device=base.device, dtype=base.dtype).view(-1, 1, 1)
    return torch.cat([base, rows.expand(-1, base.shape[1], 1)], dim=-1)


@dataclass
class _Targets:
    """What the loss function needs for one pipeline step."""

    masked: bool
    denominator: float | torch.Tensor
    label_smoothing: float
    scale: float = 1.0  # the fp16 loss scale (1 otherwise)
    token_scale: float = 1.0  # context parallelism: this rank's share of the global token mean
    mtp_denominators: tuple[float, ...] = ()  # each MTP depth's target tokens in the local batch x grad_accum
    rows: bool = False  # the targets' last column is each sequence's row in the local batch (for extra_loss)


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
        fused: bool = False,
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
        self.fused = fused  # the last stage returns each micro-batch's mean loss (the head fused into it)
        self._targets = _Targets(False, 1.0, 0.0)
        self.label_smoothing = config.train.label_smoothing
        self.mtp_depth, self.mtp_weight = config.model.mtp_depth, config.train.mtp_loss_weight
        self._mtp_shares: list[list[float]] = []  # per loss call: each depth's share of the local-batch mean
        self._mtp_totals = [0.0] * self.mtp_depth  # summed over the step's runs, over the pp group
        self._grad_accum = 1
        # A term the last stage adds to each training micro-batch's loss (distillation): called as
        # extra_loss(loss, logits, rows, mask, share) with the micro-batch's rows of the local batch and its
        # share of the local batch's tokens; None: none.
        self.extra_loss: Callable[..., torch.Tensor] | None = None
        pipe_stages = [PipelineStage(m, s, n_stages, device, group=self.pp_group) for s, m, _ in stages]
        cls = SCHEDULES[p.pp_schedule]
        first = pipe_stages if p.pp_schedule in MULTI_STAGE_SCHEDULES else pipe_stages[0]
        self.schedule = cls(first, self.microbatches, loss_fn=self._loss, scale_grads=False)
        # torch's V schedules evaluate with their training actions, whose same-rank backward hand-over fails
        # without a backward (torch 2.13): evaluation runs a forward-only schedule over the same V stages.
        self.eval_schedule = (
            _VForward(pipe_stages, self.microbatches, self._loss) if p.pp_schedule in V_SCHEDULES else self.schedule
        )

    def _loss(self, output: torch.Tensor | tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
        rows = None
        if self._targets.rows:
            rows, target = target[:, 0, -1], target[..., :-1]
            target = target if self._targets.masked else target[..., 0]
        labels, mask = (target[..., 0], target[..., 1].bool()) if self._targets.masked else (target, None)
        main, ahead = (output[0], list(output[1:])) if isinstance(output, tuple) else (output, [])
        count = labels.numel() if mask is None else mask.sum().double()  # a tensor: no host sync
        scale = count / self._targets.denominator * self._targets.token_scale
        loss = main.sum() if self.fused else self._loss_fn(main, labels, self._targets.label_smoothing, mask)
        if rows is not None:  # distillation: its term mixes into the token loss before the weights
            loss = self.extra_loss(loss, main, rows, mask, count / self._targets.denominator * self._grad_accum)
        shares = []
        if ahead:  # weighted like the main loss: each micro-batch's share of the local batch's depth-k mean
            losses = mtp_losses(ahead, labels, mask, self._loss_fn, self._targets.label_smoothing)
            counts = mtp_token_counts(labels, mask, len(ahead))
            shares = [d * (c / den) for d, c, den in zip(losses, counts, self._targets.mtp_denominators)]
            self._mtp_shares.append([float(_local(share)) for share in shares])  # MTP only: host numbers
        # the MoE losses are attached to each stage's output by its hooks (moe_aux_weight per micro-batch)
        return combine_losses(loss, LossWeights(scale, self.mtp_weight), shares) * self._targets.scale

    def metrics(self) -> dict[str, float]:
        """Each MTP depth's loss over the step's local batches (``mtp_loss_1`` ...), then reset; {} without MTP."""
        out = {f"mtp_loss_{k + 1}": v for k, v in enumerate(self._mtp_totals)}
        self._mtp_totals = [0.0] * self.mtp_depth
        return out

    def _run(
        self, batch: MicroBatch, denominator: float, train: bool, loss_scale: float = 1.0, token_scale: float = 1.0
    ) -> torch.Tensor:
        args, labels, loss_mask, model_kwargs = batch.args, batch.labels, batch.loss_mask, batch.kwargs
        smoothing = self.label_smoothing if train else 0.0
        self._targets = _Targets(loss_mask is not None, denominator, smoothing, loss_scale, token_scale)
        if train and self.mtp_depth:
            counts = mtp_token_counts(labels, loss_mask, self.mtp_depth)
            self._targets.mtp_denominators = tuple(max(c, 1) * self._grad_accum for c in counts)
        self._mtp_shares = []
        target = labels if loss_mask is None else torch.stack([labels, loss_mask.to(labels.dtype)], dim=-1)
        if train and self.extra_loss is not None and self.has_last:
            target = _with_rows(target)
            self._targets.rows = True
        losses: list[torch.Tensor] = []
        for hooks in self.hooks:
            hooks.aux_losses, hooks.logs, hooks.mtp_active = [], [], train
            hooks.label_smoothing, hooks.masked = smoothing, loss_mask is not None
        inputs = args if self.has_first else ()
        kwargs = {"target": target, "losses": losses} if self.has_last else {}
        if self.has_first:  # split into micro-batches by the schedule, like the inputs
            kwargs.update(model_kwargs or {})
            if self.fused:  # the last stage's loss needs them: they travel with the activations
                mask = torch.ones_like(labels) if loss_mask is None else loss_mask.to(labels.dtype)
                kwargs[_TARGETS] = torch.stack([labels, mask], dim=-1)
        if train:  # the micro-batches' outputs are not kept: each one's logits die with its backward
            self.schedule.step(*inputs, return_outputs=False, **kwargs)
        else:
            self.eval_schedule.eval(*inputs, **kwargs)
        # The first step's shape inference runs one extra forward per stage: count the schedule's own.
        aux = [a for hooks in self.hooks for a in hooks.aux_losses[-self.microbatches :]]
        parts = [_local(loss).double() / self._targets.scale for loss in losses] + [a.detach().double() for a in aux]
        local = torch.stack(parts).sum() if parts else torch.zeros((), dtype=torch.float64)
        # Like the MoE losses: only the schedule's own micro-batches (the first step adds shape inference's).
        mtp = [sum(col) for col in zip(*self._mtp_shares[-self.microbatches :])] or [0.0] * self.mtp_depth
        extra = torch.tensor(mtp, dtype=torch.float64, device=labels.device)
        total = torch.cat([local.to(labels.device).reshape(1), extra])
        dist.all_reduce(total, group=self.pp_group)  # a tensor: the trainer reads it with the step's one sync
        if train and self.mtp_depth:  # MTP's per-depth figures are host numbers already
            self._mtp_totals = [a + b for a, b in zip(self._mtp_totals, total[1:].tolist())]
        return total[0]

    def moe_logs(self) -> list[MoELog]:
        """The MoE stats of the last step's training forwards on this rank's stages."""
        return [log for hooks in self.hooks for log in hooks.logs[-self.microbatches :]]

    def step(
        self, batch: MicroBatch, grad_accum: int, loss_scale: float = 1.0, token_scale: float = 1.0
    ) -> torch.Tensor:
        """Forward and backward of one local batch through the pipeline; returns its loss / grad_accum.

        The number (a float64 scalar tensor, not read here) is the same on every pp rank (the last
        stage's losses plus every stage's MoE losses, summed over the pp group). ``loss_scale`` (fp16)
        multiplies every gradient, as the grad scaler's ``scale(loss)`` does outside a pipeline; the
        returned loss is unscaled. ``token_scale`` multiplies the token loss and is kept in the returned
        loss (context parallelism: this rank's share of the global token mean).
        """
        for hooks in self.hooks:
            hooks.aux_scale, hooks.grad_scale = moe_aux_weight(grad_accum, self.microbatches), loss_scale
        self._grad_accum = grad_accum
        tokens = batch.tokens() if batch.loss_mask is None else batch.tokens().clamp(min=1)
        return self._run(batch, tokens * grad_accum, True, loss_scale, token_scale)

    def reduce_shared_grads(self) -> None:
        """Sum the gradients of parameters used on several pp ranks (before clipping and stepping)."""
        reduce_shared_grads(self.shared)

    def norm_duplicates(self) -> list[torch.Tensor]:
        """Copies of shared parameters this rank leaves out of the global gradient norm."""
        return norm_duplicates(self.shared, self.pp_rank)

    def eval_loss(self, batch: MicroBatch) -> float:
        """The summed (not averaged) token loss of a batch, forward only, on every pp rank."""
        if batch.labels.shape[0] % self.microbatches:
            raise ConfigError(
                f"an evaluation batch of {batch.labels.shape[0]} sequences per rank is not divisible by "
                f"parallel.microbatches={self.microbatches}; raise train.eval_batches or the validation split"
            )
        return self._run(batch, 1.0, False).item()


def build_pipeline(
    model: nn.Module,
    dims: Any,
    config: JobConfig,
    device: torch.device,
    loss_fn: LossFn,
    parallelize_stage: Callable[[nn.Module], nn.Module],
    head_loss: HeadLoss | None = None,
) -> Pipeline:
    """Split ``model`` for this rank's pp stages, parallelize each stage, and build the schedule.

    ``parallelize_stage`` applies TP/SP -> AC -> compile -> FSDP to one stage model. With
    ``head_loss`` the last stage fuses the head into the loss (a decoder or an encoder; an
    encoder-decoder's stages carry their own tensors and keep ``loss_fn`` on its logits).
    """
    p = config.parallel
    if config.model.mtp_depth and p.cp > 1:  # the last stage would roll its own slice's targets
        raise ConfigError("model.mtp_depth with parallel.pp > 1 and parallel.cp > 1 is not supported; use pp or cp")
    pp_mesh = dims.submesh("pp")
    v = virtual_stages(p)
    n_stages = p.pp * v
    stage_ids = local_stage_ids(pp_mesh.get_local_rank(), p.pp, v, p.pp_schedule)
    on_meta = any(p.is_meta for p in model.parameters())  # meta init: materialized after sharding
    local, stage_models, shared = split_model(model if on_meta else model.to(device), config, stage_ids)
    sp_mesh = dims.submesh("tp") if p.tp > 1 and p.sequence_parallel else None
    stages = []
    for stage_id, stage in zip(stage_ids, stage_models):
        with warnings.catch_warnings():  # the TP plan names modules other stages hold
            warnings.filterwarnings("ignore", message="Parallelize plan key")
            stage = parallelize_stage(stage)
        hooks = StageHooks(stage_id == 0, stage_id == n_stages - 1, config.model.max_seq_len, sp_mesh)
        hooks.mtp = bool(config.model.mtp_depth)
        if config.model.arch == "encoder_decoder":
            hooks.vocab_size = config.model.vocab_size
        else:
            hooks.head_loss, hooks.vocab = head_loss, config.model.vocab_size
            hooks.split_backward = p.pp_schedule in SPLIT_BACKWARD_SCHEDULES
        hooks.install(stage)
        stages.append((stage_id, stage, hooks))
    tie_local_uses(shared, local)
    make_groups(shared, dims.mesh, pp_mesh.get_group())
    fused = head_loss is not None and config.model.arch != "encoder_decoder"
    pipeline = Pipeline(local, stages, n_stages, config, pp_mesh, device, loss_fn, fused)
    pipeline.shared = shared
    return pipeline
