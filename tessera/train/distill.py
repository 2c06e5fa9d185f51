"""Knowledge distillation (``train.distill.teacher``): the loss mixes cross-entropy with the KL divergence
from a teacher's to the student's temperature-softened next-token distributions (Hinton et al. 2015):

    loss = (1 - alpha) * CE(student, labels) + alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T))

averaged over the same (masked) positions as the cross-entropy. The teacher is a trained tessera run
or checkpoint with the same tokenizer; it runs in eval mode without gradients, a full replica on
every data-parallel rank, on the same micro-batches as the student (the layout's data split).
"""

from __future__ import annotations

import contextlib
import filecmp
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tessera.errors import ConfigError
from tessera.train.distributed import scalar


def distill_kl(
    student: torch.Tensor, teacher: torch.Tensor, temperature: float, loss_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean over positions (where ``loss_mask`` is true) of KL(teacher || student) of logits (B, T, V) at
    ``temperature``, in float32."""
    log_s = F.log_softmax(student.float() / temperature, dim=-1)
    log_t = F.log_softmax(teacher.float() / temperature, dim=-1)
    per_token = F.kl_div(log_s, log_t, log_target=True, reduction="none").sum(-1)
    if loss_mask is None:
        return per_token.mean()
    mask = loss_mask.float()
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


def load_teacher(path: str, vocab_size: int, tokenizer: Path, device: torch.device) -> nn.Module:
    """The teacher model of run or checkpoint ``path`` on ``device``, frozen, after checking that it reads the
    student's tokens (same vocabulary size, same tokenizer file when the run has one)."""
    from tessera.api import find_checkpoint, load

    ckpt = find_checkpoint(path)
    teacher = load(ckpt)
    if teacher.cfg.arch != "decoder" or teacher.cfg.vocab_size != vocab_size:
        raise ConfigError(
            f"train.distill.teacher={path!r} is a {teacher.cfg.arch} with a vocabulary of {teacher.cfg.vocab_size}; "
            "the "
            f"student needs a decoder with its own {vocab_size} tokens (train both with the same tokenizer)"
        )
    theirs = ckpt.parent.parent / "tokenizer.model"
    if theirs.is_file() and not filecmp.cmp(theirs, tokenizer, shallow=False):
        raise ConfigError(
            f"train.distill.teacher={path!r} was trained with another tokenizer ({theirs}); use the same data.tokenizer"
        )
    return teacher.to(device).eval().requires_grad_(False)


class Distillation:
    """Mixes each micro-batch's cross-entropy with the KL from the teacher; reports the KL per step."""

    def __init__(
        self,
        teacher: nn.Module,
        temperature: float,
        alpha: float,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ) -> None:
        self.teacher, self.temperature, self.alpha, self.autocast = teacher, temperature, alpha, autocast
        self._sum, self._count = 0.0, 0

    def add(
        self,
        loss: torch.Tensor,
        logits: torch.Tensor,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        loss_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """``(1 - alpha) * loss + alpha * T^2 * KL(teacher || student)`` on the micro-batch ``args, kwargs``."""
        with torch.no_grad(), self.autocast():
            teacher_logits = self.teacher(*args, **kwargs)
        kl = distill_kl(logits, teacher_logits, self.temperature, loss_mask)
        self._sum += scalar(kl)
        self._count += 1
        return (1 - self.alpha) * loss + (self.alpha * self.temperature**2) * kl

    def metrics(self) -> dict[str, float]:
        """The mean KL over the micro-batches since the last call."""
        out = {"distill_kl": self._sum / max(self._count, 1)}
        self._sum, self._count = 0.0, 0
        return out
