"""Distillation (train.distill.teacher): the KL term's arithmetic, the teacher checks, a student that learns
more from the teacher than from the labels alone, and parity with one process under TP/SP, PP, CP and FSDP."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from helpers.hf_reference import save_llama
from helpers.runs import TINY_OVERRIDES, assert_losses_close, assert_runs_match, step_records, torchrun

from tessera.config import ConfigError
from tessera.hf.convert import hf_import
from tessera.train.distill import check_teacher_tokenizer, distill_kl, open_teacher
from tessera.train.trainer import Trainer, train
from tessera.validate import load_config

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


def test_a_run_teacher_with_another_vocabulary_or_tokenizer_is_refused(tiny_config, tmp_path):
    Trainer(tiny_config("train.steps=2", "checkpoint.every=2", "train.eval_every=0", run_dir=tmp_path / "t")).fit()
    teacher = f"train.distill.teacher={tmp_path / 't'}"
    with pytest.raises(ConfigError, match="vocabulary of 512"):
        open_teacher(tiny_config("model.vocab_size=384", teacher))
    source = open_teacher(tiny_config(teacher))
    other = tmp_path / "other" / "tokenizer.model"
    other.parent.mkdir()
    other.write_bytes(b"another tokenizer")
    with pytest.raises(ConfigError, match="another tokenizer"):
        check_teacher_tokenizer(source, other)
    check_teacher_tokenizer(source, tmp_path / "t" / "tokenizer.model")


@pytest.mark.slow
def test_distillation_under_tp_sp_pp_cp_and_fsdp_equals_one_process(tmp_path, cache_dir):
    """An HF teacher distilled into an HF-initialized student under tp=2 with sequence parallelism, pp=2, cp=2
    and dp_shard=2 (one 2-process world): every step's loss, grad norm and KL, and the final parameter checksums,
    equal the single-process run (1e-5, fp32). Under pp=2 and cp=2 the teacher is the same weights as a tessera
    checkpoint (DCP, read by each rank alone: only the last stage holds it; FSDP shards it over cp)."""
    save_llama(tmp_path / "student")
    hf_import(tmp_path / "student", tmp_path / "imported")
    save_llama(tmp_path / "teacher", seed=1)
    hf_import(tmp_path / "teacher", tmp_path / "teacher_run")
    as_run = f"train.distill.teacher={tmp_path / 'teacher_run'}"
    recipe = str(tmp_path / "imported" / "config.toml")
    common = [
        *[o for o in TINY_OVERRIDES if not o.startswith("model.")],
        "train.steps=3",
        "train.eval_every=0",
        "checkpoint.enabled=false",
        f"data.cache_dir={cache_dir}",
        f"train.init_from={tmp_path / 'student'}",
        f"train.distill.teacher={tmp_path / 'teacher'}",
        "train.distill.temperature=2.0",
        "train.distill.alpha=0.5",
    ]
    train(load_config(recipe, [*common, f"train.run_dir={tmp_path / 'single'}"]))
    jobs = {
        "tp2_sp": [recipe, *common, "parallel.dp_shard=1", "parallel.tp=2", "parallel.sequence_parallel=true"],
        "pp2": [recipe, *common, as_run, "parallel.dp_shard=1", "parallel.pp=2", "parallel.microbatches=2"],
        "cp2": [recipe, *common, as_run, "parallel.dp_shard=1", "parallel.cp=2"],
        "dp_shard2": [recipe, *common, "parallel.dp_shard=2"],
    }
    torchrun(2, "tests/helpers/dist_init_from.py", str(tmp_path), json.dumps(jobs))
    want = [r["distill_kl"] for r in step_records(tmp_path / "single")]
    assert min(want) > 0.01
    for name in jobs:
        assert assert_runs_match(tmp_path / name, tmp_path / "single") == 3, name
        assert_losses_close([r["distill_kl"] for r in step_records(tmp_path / name)], want, 1e-5, what=f"{name} KL")
