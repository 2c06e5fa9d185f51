"""One step runner per engine: plain torch, pipeline, DeepSpeed; the trainer picks one when it is built.

Every runner has the same :meth:`TorchSteps.step` (one optimizer step over ``train.grad_accum``
micro-batches, its metrics back), :meth:`~TorchSteps.eval_loss`, checkpoint save and load, and the
final parameter checksums, so the training loop never asks which engine it runs:

- :class:`TorchSteps`: the model's loss per micro-batch (:class:`ModelLoss`), backward through the
  grad scaler, then the global gradient norm, the non-finite and spike guards, clipping and the
  optimizer and LR steps (FSDP2 / DDP / TP / CP / EP).
- :class:`PipelineSteps`: the same update after a ``torch.distributed.pipelining`` schedule ran each
  micro-batch's forwards and backwards; the loss of its last stage is the same
  :func:`~tessera.parallel.loss.combine_losses` the torch runner's :class:`ModelLoss` calls.
- :class:`DeepSpeedSteps`: the same losses, with backward, reduction, clipping and the update
  handed to the DeepSpeed engine (``train/engine.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tessera.config import ConfigError, JobConfig
from tessera.model import MoELog, moe_loss
from tessera.parallel.checksum import parameter_sums_of_squares
from tessera.parallel.grads import clip_grads, global_grad_norm
from tessera.parallel.loss import LossWeights, MicroBatch, combine_losses
from tessera.parallel.pipeline import Pipeline
from tessera.train.distill import Distillation
from tessera.train.distributed import ParallelContext, local_value, scalar
from tessera.train.engine import DeepSpeedEngine
from tessera.train.guard import NonFiniteGuard
from tessera.train.loss import FusedHeadLoss, lm_loss
from tessera.train.moe_stats import ExpertLoadTracker
from tessera.train.mtp_loss import MTP_AHEAD_KEYS, MTPLoss
from tessera.train.optim import build_optimizer, build_scheduler
from tessera.train.qk_clip import QKClip
from tessera.train.spike import SpikeGuard

Autocast = Callable[[], contextlib.AbstractContextManager]


class ModelLoss:
    """A micro-batch's loss through the model: the head fused into the loss unless ``train.fused_loss=false``
    (or ``fused=False``: the DeepSpeed engine, distillation), plus distillation, MTP and MoE terms."""

    def __init__(
        self,
        model: nn.Module,
        config: JobConfig,
        parallel: ParallelContext,
        autocast: Autocast,
        extra: tuple[MTPLoss | None, Distillation | None],
        fused: bool,
    ) -> None:
        self.model, self.config, self.parallel, self.autocast = model, config, parallel, autocast
        self.mtp, self.distill = extra
        self.fused = fused

    def context(self) -> contextlib.AbstractContextManager:
        """``loss_parallel`` for the unfused loss on vocab-sharded logits (the fused loss needs none)."""
        fused_only = self.fused and self.mtp is None  # MTP's own heads make logits (training)
        return contextlib.nullcontext() if fused_only else self.parallel.loss_context()

    def __call__(
        self,
        batch: MicroBatch,
        label_smoothing: float,
        moe_log: MoELog | None,
        training: bool = True,
        token_scale: float = 1.0,
    ) -> torch.Tensor:
        """The micro-batch's mean loss (times ``token_scale``: under context parallelism this rank's share
        of the global token mean) plus (training) its distillation, multi-token-prediction and MoE losses."""
        mtp = self.mtp if training else None
        kwargs = dict(batch.kwargs)
        ahead = {k: kwargs.pop(k) for k in MTP_AHEAD_KEYS if k in kwargs}  # made before the cp split
        extra = mtp.forward_kwargs(ahead.get("mtp_tokens")) if mtp is not None else {}
        labels, mask = batch.labels, batch.loss_mask
        with self.autocast():
            if self.fused:
                head = FusedHeadLoss(labels, mask, label_smoothing, self.config.train.loss_chunk_tokens)
                main = self.model(*batch.args, **kwargs, moe_log=moe_log, output_fn=head, **extra)
            else:
                logits = self.model(*batch.args, **kwargs, moe_log=moe_log, **extra)
        if not self.fused:
            main = lm_loss(logits, labels, label_smoothing, mask)
        distill = None
        if self.distill is not None and training:  # never fused: it reads the student's logits
            distill = lambda loss: self.distill.add(loss, logits, batch.args, batch.kwargs, mask, token_scale)  # noqa: E731
        depths = self._depth_losses(mtp, labels, mask, ahead) if mtp is not None else []
        aux = moe_loss(moe_log) if moe_log is not None else None  # MoE load-balancing and router z-losses
        weights = LossWeights(token_scale, self.config.train.mtp_loss_weight)
        return combine_losses(main, weights, depths, aux, distill)

    def _depth_losses(
        self, mtp: MTPLoss, labels: torch.Tensor, mask: torch.Tensor | None, ahead: dict[str, torch.Tensor]
    ) -> list[torch.Tensor]:
        """Each MTP depth's loss; under context parallelism from the pre-split targets, each times this rank's
        share of that depth's global token mean (its own count: the last positions' targets are left out)."""
        if "mtp_labels" not in ahead:
            return mtp.depth_losses(labels, mask)
        targets = [(ahead["mtp_labels"][..., k], ahead["mtp_mask"][..., k]) for k in range(mtp.depth)]
        losses = mtp.depth_losses(labels, mask, targets)
        return [loss * self.parallel.loss_scale(t, m) for loss, (t, m) in zip(losses, targets)]


@dataclass
class StepParts:
    """What a step runner works on (the trainer builds them)."""

    config: JobConfig
    parallel: ParallelContext
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler
    loss: ModelLoss
    autocast: Autocast
    nonfinite: NonFiniteGuard
    spikes: SpikeGuard
    moe_tracker: ExpertLoadTracker | None
    qk_clip: QKClip | None
    extra_metrics: Callable[[], dict[str, float]]  # MTP and distillation figures of the step, over dp


class TorchSteps:
    """FSDP2 / DDP / TP / CP / EP under torch: the trainer computes, scales and steps itself.

    The base of the other runners: ``step``, ``eval_loss``, ``save``, ``load``,
    ``parameter_sums_of_squares`` and ``metrics`` are what the trainer calls, the same for each.
    """

    scales_fp16_itself = False  # the engine scales fp16 losses itself (no GradScaler)
    fuses_head = True  # the fused head and loss work under this engine

    def __init__(self, parts: StepParts) -> None:
        self.parts = parts

    @classmethod
    def check_config(cls, config: JobConfig) -> None:
        """Refuse what this engine cannot do (nothing, for torch)."""

    @classmethod
    def prepare(cls, config: JobConfig, model: nn.Module, parallel: ParallelContext) -> tuple[Any, ...]:
        """(engine, model, optimizer, LR schedule) to train with: torch's optimizer and schedule, no engine."""
        optimizer = build_optimizer(model, config.optim)
        return None, model, optimizer, build_scheduler(optimizer, config.optim, config.train.steps)

    @classmethod
    def create(cls, parts: StepParts, engine: DeepSpeedEngine | None, pipeline: Pipeline | None) -> TorchSteps:
        """The runner over ``parts`` (and the engine or pipeline it drives)."""
        return cls(parts)

    def metrics(self) -> dict[str, float]:
        """Per-step figures the engine itself keeps (a pipeline's MTP losses); {} otherwise."""
        return {}

    def bind_loader(self, loader: Any) -> None:
        """The training loader, for a runner that rewinds or hands on the data position (torchft's); unused here."""

    def summary(self) -> dict[str, Any]:
        """Run totals the runner keeps for summary.json ({} here; torchft's: redone steps, live recoveries)."""
        return {}

    def step(self, step: int, next_batch: Callable[[], MicroBatch]) -> dict[str, Any]:
        """One optimizer step; without MoE the host waits for the device once (loss and grad norm together)."""
        losses, moe_logs = self._accumulate(next_batch)
        p = self.parts
        p.scaler.unscale_(p.optimizer)
        grad_norm = global_grad_norm(p.model.parameters(), p.parallel.pp_mesh, self._norm_skip())
        loss = p.parallel.mean_over_dp(torch.stack([x.double() for x in losses]).sum())
        loss_value, norm_value = torch.stack([loss, grad_norm.double()]).tolist()  # the step's one host sync
        lr = p.scheduler.get_last_lr()[0]
        self._update(step, loss_value, norm_value, lr)
        moe_logs = self._moe_logs(moe_logs)
        moe = p.moe_tracker.step(moe_logs) if p.moe_tracker is not None else {}  # all ranks' load; aux-free bias
        qk = p.qk_clip.metrics() if p.qk_clip else {}  # max attention logit per layer
        return {"loss": loss_value, "lr": lr, "grad_norm": norm_value, **moe, **qk, **p.extra_metrics()}

    def _accumulate(self, next_batch: Callable[[], MicroBatch]) -> tuple[list[torch.Tensor], list[MoELog]]:
        """Forward and backward of each micro-batch: (its loss / grad_accum, detached; its MoE stats)."""
        p = self.parts
        accum, smoothing = p.config.train.grad_accum, p.config.train.label_smoothing
        losses: list[torch.Tensor] = []
        moe_logs: list[MoELog] = []
        for _ in range(accum):
            batch = next_batch()
            scale = p.parallel.loss_scale(batch.labels, batch.loss_mask)  # cp: local tokens' share of the global mean
            moe_logs.append(MoELog())
            with p.loss.context():
                loss = p.loss(batch, smoothing, moe_logs[-1], token_scale=scale) / accum
                self._backward(loss)
            losses.append(local_value(loss.detach()))
        return losses, moe_logs

    def _backward(self, loss: torch.Tensor) -> None:
        self.parts.scaler.scale(loss).backward()

    def _norm_skip(self) -> list[torch.Tensor]:
        """Parameters left out of the gradient norm (none outside a pipeline)."""
        return []

    def _moe_logs(self, accumulated: list[MoELog]) -> list[MoELog]:
        return accumulated

    def _update(self, step: int, loss: float, grad_norm: float, lr: float) -> None:
        """Clip and apply the step's update unless ``train.on_nonfinite`` forbids it (host floats: no sync)."""
        p = self.parts
        # With fp16 the grad scaler itself skips steps whose gradients overflowed; only the loss is judged.
        norm = 0.0 if p.scaler.is_enabled() else grad_norm
        if p.nonfinite.allows_update(step, loss, norm, lr) and p.spikes.judge(step, loss, norm):
            clip_grads(p.model.parameters(), p.config.optim.grad_clip, grad_norm)
            p.scaler.step(p.optimizer)
            p.scaler.update()
            p.scheduler.step()
        p.optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def eval_loss(self, batch: MicroBatch, weight: float) -> float:
        """The batch's summed token loss (its mean times ``weight``, its counted tokens)."""
        with self.parts.loss.context():
            return scalar(self.parts.loss(batch, 0.0, None, training=False)) * weight

    def save(self, checkpointer: Any, step: int, extra: dict[str, Any]) -> Path:
        """Checkpoint the model, optimizer and ``extra`` at ``step``."""
        return checkpointer.save(step, self.parts.model, self.parts.optimizer, extra)

    def load(self, checkpointer: Any, path: Path) -> dict[str, Any]:
        """Restore the model and optimizer from ``path``; returns the checkpoint's metadata."""
        return checkpointer.load(path, self.parts.model, self.parts.optimizer)

    def parameter_sums_of_squares(self) -> dict[str, float]:
        """Per-parameter sums of squares of the whole model (collective: every rank)."""
        return parameter_sums_of_squares(self.parts.model)


class PipelineSteps(TorchSteps):
    """pp > 1: the schedule runs each micro-batch's forwards and backwards; the update is the torch one."""

    def __init__(self, parts: StepParts, pipeline: Pipeline) -> None:
        super().__init__(parts)
        self.pipeline = pipeline

    @classmethod
    def create(cls, parts: StepParts, engine: DeepSpeedEngine | None, pipeline: Pipeline | None) -> TorchSteps:
        """The runner driving ``pipeline``'s schedule."""
        return cls(parts, pipeline)

    def _accumulate(self, next_batch: Callable[[], MicroBatch]) -> tuple[list[torch.Tensor], list[MoELog]]:
        p = self.parts
        accum = p.config.train.grad_accum
        losses = []
        for _ in range(accum):
            batch = next_batch()
            scale = p.parallel.loss_scale(batch.labels, batch.loss_mask)  # cp: local tokens' share of the global mean
            if p.loss.distill is not None:  # the last stage picks each micro-batch's rows of this batch
                p.loss.distill.prepare(batch.args, batch.kwargs, scale)
            with p.parallel.loss_context(), p.autocast():
                losses.append(self.pipeline.step(batch, accum, self._fp16_scale(), token_scale=scale))
        return losses, []

    def _fp16_scale(self) -> float:
        """The fp16 loss scale for the schedule (which runs backward itself), else 1."""
        scaler = self.parts.scaler
        if not scaler.is_enabled():
            return 1.0
        scaler.scale(torch.zeros((), device=self.parts.parallel.device))  # initializes the scaler's state
        return float(scaler.get_scale())

    def _norm_skip(self) -> list[torch.Tensor]:
        """Parameters used on several pp ranks: their gradients summed first, counted once in the norm."""
        self.pipeline.reduce_shared_grads()
        return self.pipeline.norm_duplicates()

    def _moe_logs(self, accumulated: list[MoELog]) -> list[MoELog]:
        return self.pipeline.moe_logs()

    @torch.no_grad()
    def eval_loss(self, batch: MicroBatch, weight: float) -> float:
        """The batch's summed token loss through the schedule (forward only, on every pp rank)."""
        with self.parts.parallel.loss_context(), self.parts.autocast():
            return self.pipeline.eval_loss(batch)

    def metrics(self) -> dict[str, float]:
        """Each MTP depth's loss of the step (the last stage computes them), {} without MTP."""
        return self.pipeline.metrics()


class DeepSpeedSteps(TorchSteps):
    """``parallel.engine = "deepspeed"``: the same losses; backward, reduction, clipping and update by DeepSpeed."""

    scales_fp16_itself = True
    fuses_head = False  # ZeRO-3 gathers the head's weight only inside the head's own forward

    def __init__(self, parts: StepParts, engine: DeepSpeedEngine) -> None:
        super().__init__(parts)
        self.engine = engine

    @classmethod
    def prepare(cls, config: JobConfig, model: nn.Module, parallel: ParallelContext) -> tuple[Any, ...]:
        """(engine, its wrapped model, its optimizer, its LR schedule)."""
        engine = DeepSpeedEngine(config, model, parallel)
        return engine, engine.model, engine.optimizer, engine.scheduler

    @classmethod
    def create(cls, parts: StepParts, engine: DeepSpeedEngine | None, pipeline: Pipeline | None) -> TorchSteps:
        """The runner handing backward and update to ``engine``."""
        return cls(parts, engine)

    @classmethod
    def check_config(cls, config: JobConfig) -> None:
        """checkpoint.async cannot overlap DeepSpeed's saves."""
        if config.checkpoint.async_save:
            raise ConfigError(
                "checkpoint.async=true does not work with parallel.engine=deepspeed (its saves gather full tensors "
                "with collectives); set checkpoint.async=false"
            )

    def _backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self, step: int, next_batch: Callable[[], MicroBatch]) -> dict[str, Any]:
        """The engine's reduce, clip and update; ``train.on_nonfinite`` judges the loss before it (skipping is
        refused at config time: DeepSpeed's step cannot be held back) and the grad norm after."""
        losses, moe_logs = self._accumulate(next_batch)
        p = self.parts
        loss = p.parallel.mean_over_dp(torch.stack(losses).sum()).item()
        lr = p.scheduler.get_last_lr()[0]
        p.nonfinite.allows_update(step, loss, 0.0, lr)
        grad_norm = self.engine.step()
        p.nonfinite.allows_update(step, loss, grad_norm, lr)
        p.spikes.judge(step, loss, grad_norm)  # a rollback restores the checkpoint over the update
        moe = p.moe_tracker.step(moe_logs) if p.moe_tracker is not None else {}
        return {"loss": loss, "lr": lr, "grad_norm": grad_norm, **moe}

    def save(self, checkpointer: Any, step: int, extra: dict[str, Any]) -> Path:
        """Full weights and Adam state in tessera's layout (see :meth:`DeepSpeedEngine.save`)."""
        return self.engine.save(checkpointer, step, extra)

    def load(self, checkpointer: Any, path: Path) -> dict[str, Any]:
        """Full weights and Adam state from a checkpoint of any engine and layout."""
        return self.engine.load(path)

    def parameter_sums_of_squares(self) -> dict[str, float]:
        """Per-parameter sums of squares of the full fp32 weights (collective)."""
        return self.engine.parameter_sums_of_squares()


def runner_class(config: JobConfig) -> type[TorchSteps]:
    """The runner ``[parallel]`` asks for: DeepSpeed's engine, a pipeline (pp > 1), or plain torch."""
    if config.parallel.engine == "deepspeed":
        return DeepSpeedSteps
    return PipelineSteps if config.parallel.pp > 1 else TorchSteps
