"""Distillation (train.distill_from): the KL term's arithmetic, the teacher checks, and a student that learns
more from the teacher than from the labels alone in the same number of steps."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tessera.config import ConfigError
from tessera.train.distill import distill_kl, load_teacher
from tessera.train.trainer import Trainer

TEACHER = ["model.n_layers=4", "train.steps=120", "optim.lr=3e-3", "train.eval_every=0", "checkpoint.every=120"]
STUDENT = [
    "model.dim=32",
    "model.n_layers=2",
    "train.steps=30",
    "optim.lr=3e-3",
    "train.eval_every=30",
    "checkpoint.enabled=false",
]


def test_kl_is_the_mean_over_unmasked_positions_of_the_softened_divergence():
    torch.manual_seed(0)
    student, teacher = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 3:] = False
    p = F.softmax(teacher / 2.0, -1)
    per_token = (p * (p.log() - F.log_softmax(student / 2.0, -1))).sum(-1)
    torch.testing.assert_close(distill_kl(student, teacher, 2.0, mask), per_token[mask].mean())
    assert distill_kl(teacher, teacher, 3.0).abs() < 1e-6


def test_distilled_student_beats_the_same_student_trained_alone(tiny_config, tmp_path):
    teacher = Trainer(tiny_config(*TEACHER, run_dir=tmp_path / "teacher")).fit()
    alone = Trainer(tiny_config(*STUDENT, run_dir=tmp_path / "alone")).fit()
    distilled = Trainer(
        tiny_config(
            *STUDENT,
            f"train.distill_from={tmp_path / 'teacher'}",
            "train.distill_alpha=0.9",
            run_dir=tmp_path / "distilled",
        )
    ).fit()
    with_teacher, without = distilled.val_losses[30], alone.val_losses[30]
    print(f"teacher trained {teacher.losses[-1]:.3f}; student val loss {with_teacher:.4f} distilled vs {without:.4f}")
    assert math.isfinite(with_teacher) and with_teacher < without


def test_a_teacher_with_another_vocabulary_is_refused(tiny_config, tmp_path):
    Trainer(tiny_config("train.steps=2", "checkpoint.every=2", "train.eval_every=0", run_dir=tmp_path / "t")).fit()
    tokenizer = tmp_path / "t" / "tokenizer.model"
    with pytest.raises(ConfigError, match="vocabulary of 512"):
        load_teacher(str(tmp_path / "t"), 300, tokenizer, torch.device("cpu"))
    with pytest.raises(ConfigError, match="another tokenizer"):
        load_teacher(str(tmp_path / "t"), 512, Path(__file__), torch.device("cpu"))
    assert not any(
        p.requires_grad for p in load_teacher(str(tmp_path / "t"), 512, tokenizer, torch.device("cpu")).parameters()
    )
