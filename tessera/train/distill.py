"""Knowledge distillation (``train.distill.teacher``): the loss mixes cross-entropy with the KL divergence
from a teacher's to the student's temperature-softened next-token distributions (Hinton et al. 2015):

    loss = (1 - alpha) * CE(student, labels) + alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T))

averaged over the same (masked) positions as the cross-entropy. The teacher is an HF model directory, a
tessera run or checkpoint, or a DeepSpeed checkpoint, with the student's vocabulary; it is opened and checked
like ``train.init_from`` (:mod:`tessera.train.init_from`) before any process group starts, built on the meta
device, placed under the student's layout and filled shard by shard (each rank reads only the blocks it holds).
It runs in eval mode without gradients on the student's micro-batches:

- data parallelism, FSDP/HSDP: like the student (FSDP shards the teacher too; DDP never wraps it);
- tensor/sequence parallelism: its logits stay vocab-sharded like the student's, and the KL's log-softmaxes
  reduce their max and log-sum-exp over the tp ranks (DTensor Partial placements, :func:`log_softmax`);
- context parallelism: the teacher's attention is context-parallel too, each rank distils its own token
  slice, weighted by its share of the global token mean like the cross-entropy;
- pipeline parallelism: a whole (unsplit) teacher lives on the last stage's ranks only, and runs inside the
  last stage's loss on the rows of the local batch that the micro-batch holds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import filecmp
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from tessera.config import ConfigError, JobConfig, ModelConfig
from tessera.layout import check_model_layout
from tessera.parallel.loss import add_replicated
from tessera.train.distributed import ParallelContext, scalar
from tessera.train.init_from import InitSource, check_tensors, open_source

KEY = "train.distill.teacher"


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """``log_softmax`` over the last dimension, also of a vocab-sharded DTensor (tensor parallelism): its max and
    its sum of exponentials come out Partial (one per tp rank's shard of the vocabulary) and are reduced over the
    tp ranks, with DTensor's autograd. (``loss_parallel``'s log-softmax is not used: its backward assumes the
    NLL loss follows.)"""
    top = logits.detach().amax(-1, keepdim=True)  # for stability only: the result does not depend on it
    if isinstance(top, DTensor):
        top = top.redistribute(placements=[Replicate()] * top.device_mesh.ndim)
    shifted = logits - top
    return shifted - shifted.exp().sum(-1, keepdim=True).log()


def distill_kl(
    student: torch.Tensor, teacher: torch.Tensor, temperature: float, loss_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean over positions (where ``loss_mask`` is true) of KL(teacher || student) of logits (B, T, V) at
    ``temperature``, in float32; the logits may be vocab-sharded DTensors (see :func:`log_softmax`)."""
    log_s = log_softmax(student.float() / temperature)
    log_t = log_softmax(teacher.float() / temperature)
    per_token = (log_t.exp() * (log_t - log_s)).sum(-1)
    if isinstance(per_token, DTensor):  # each tp rank summed its share of the vocabulary: add the shares
        per_token = per_token.full_tensor()
    if loss_mask is None:
        return per_token.mean()
    mask = loss_mask.float()
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


def teacher_job(config: JobConfig, teacher: ModelConfig) -> JobConfig:
    """The student's job with the teacher's ``[model]``: the layout it is placed under (no activation
    checkpointing, no compile, no fp8: it never runs backward)."""
    parallel = dataclasses.replace(config.parallel, activation_checkpoint="none", compile=False)
    train = dataclasses.replace(config.train, fp8="off", qat="none")
    return dataclasses.replace(config, model=teacher, parallel=parallel, train=train)


def open_teacher(config: JobConfig) -> InitSource | None:
    """Before any process group: the teacher opened (headers, metadata) and checked, or None without one.
    It must be a decoder with the student's vocabulary, its tensors must fit its own config, and its shape
    must fit the student's layout (heads divisible by tp, ...)."""
    path = config.train.distill.teacher
    if not path:
        return None
    source = open_source(path, config.model, key=KEY)
    cfg, vocab = source.cfg, config.model.vocab_size
    if cfg.arch != "decoder" or cfg.vocab_size != vocab:
        raise ConfigError(
            f"{KEY}='{path}' is a {cfg.arch} with a vocabulary of {cfg.vocab_size} ({source.kind}); the student "
            f"needs a decoder with its own {vocab} tokens (train both with the same tokenizer)"
        )
    check_tensors(source, cfg)
    try:
        check_model_layout(teacher_job(config, cfg))
    except ConfigError as err:
        raise ConfigError(f"{KEY}='{path}' ({source.kind}) does not fit the layout: {err}") from None
    return source


def check_teacher_tokenizer(source: InitSource, tokenizer: Path) -> None:
    """A teacher that ships a tokenizer file must ship the student's (the same ids for the same tokens)."""
    home = source.path.parent.parent if source.kind.startswith("tessera checkpoint") else source.path
    theirs = home / tokenizer.name
    if tokenizer.is_file() and theirs.is_file() and not filecmp.cmp(theirs, tokenizer, shallow=False):
        raise ConfigError(
            f"{KEY}='{source.path}' was trained with another tokenizer ({theirs}); use the same data.tokenizer"
        )


def build_teacher(source: InitSource, config: JobConfig, parallel: ParallelContext) -> nn.Module:
    """The teacher under the student's layout, filled from ``source`` shard by shard, frozen, in eval mode."""
    from tessera.model import build_model
    from tessera.parallel.init import shard_seeds

    with torch.device("meta"):
        teacher = build_model(source.cfg)
    teacher.requires_grad_(False)
    teacher = parallel.parallelize(teacher, teacher_job(config, source.cfg), frozen=True)
    teacher.to_empty(device=parallel.device)
    with torch.no_grad():
        teacher.init_weights(shard_seeds(config.train.seed))  # buffers (RoPE tables); the weights come next
    source.load_into(teacher, no_dist=True)
    return teacher.eval()


def _rows(x: Any, rows: torch.Tensor, batch: int) -> Any:
    return x[rows] if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == batch else x


class Distillation:
    """Mixes each micro-batch's cross-entropy with the KL from the teacher; reports the KL per step.

    ``teacher`` is None on the pipeline ranks without the last stage (they only report zeros). Under a
    pipeline, ``microbatches``: only each step's last that many loss calls count in the metric (the schedule's
    shape inference on the first step calls the loss once more, on placeholder activations)."""

    def __init__(
        self,
        teacher: nn.Module | None,
        temperature: float,
        alpha: float,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        microbatches: int = 0,
    ) -> None:
        self.teacher, self.temperature, self.alpha, self.autocast = teacher, temperature, alpha, autocast
        self._sum, self._count = 0.0, 0.0
        self._batch: tuple[tuple[Any, ...], dict[str, Any], float] = ((), {}, 1.0)
        self.microbatches, self._pending = microbatches, []

    def _kl(self, logits: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any], mask: torch.Tensor | None):
        with torch.no_grad(), self.autocast():
            teacher_logits = self.teacher(*args, **kwargs)
        return distill_kl(logits, teacher_logits, self.temperature, mask)

    def _mix(self, loss: torch.Tensor, kl: torch.Tensor, weight: float) -> torch.Tensor:
        return add_replicated((1 - self.alpha) * loss, (self.alpha * self.temperature**2 * weight) * kl)

    def add(
        self,
        loss: torch.Tensor,
        logits: torch.Tensor,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        loss_mask: torch.Tensor | None,
        token_scale: float = 1.0,
    ) -> torch.Tensor:
        """``(1 - alpha) * loss + alpha * T^2 * KL(teacher || student) * token_scale`` on the micro-batch
        ``args, kwargs`` (``loss`` already carries ``token_scale``: context parallelism's share of the mean)."""
        kl = self._kl(logits, args, kwargs, loss_mask)
        self._sum += scalar(kl) * token_scale
        self._count += 1.0
        return self._mix(loss, kl, token_scale)

    def prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any], token_scale: float = 1.0) -> None:
        """The local batch a pipeline step is about to run (its last stage picks each micro-batch's rows)."""
        self._commit()
        self._batch = (args, kwargs, token_scale)

    def _commit(self) -> None:
        for value, share in self._pending[-self.microbatches :]:
            self._sum, self._count = self._sum + value, self._count + share
        self._pending = []

    def add_rows(
        self, loss: torch.Tensor, logits: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor | None, share: Any
    ) -> torch.Tensor:
        """:meth:`add` for a pipeline micro-batch: the rows ``rows`` of the prepared batch, whose tokens are
        ``share`` of the batch's (the pipeline scales the mix by the share and the token scale itself)."""
        args, kwargs, token_scale = self._batch
        batch = next(a.shape[0] for a in args if isinstance(a, torch.Tensor))
        picked = tuple(_rows(a, rows, batch) for a in args), {k: _rows(v, rows, batch) for k, v in kwargs.items()}
        kl = self._kl(logits, *picked, mask)
        self._pending.append((scalar(kl) * float(share) * token_scale, float(share)))
        return self._mix(loss, kl, 1.0)

    def metrics(self) -> dict[str, float]:
        """The mean KL over the micro-batches since the last call (times the token scale: summed over the
        context-parallel ranks and divided by their number it is the whole sequences' mean)."""
        self._commit()
        out = {"distill_kl": self._sum / max(self._count, 1.0) if self._count else 0.0}
        self._sum, self._count = 0.0, 0.0
        return out
