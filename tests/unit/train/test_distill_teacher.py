"""train.distill.teacher from an HF directory: each step's loss, grad norm and KL equal a plain transformers +
AdamW loop that distils the same teacher by hand; a bad teacher is one line, exit 2, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.hf_reference import save_llama, transformers_loop
from helpers.runs import TINY_OVERRIDES, assert_losses_close, step_records

from tessera.cli import main
from tessera.hf.convert import hf_import
from tessera.train.trainer import Trainer
from tessera.validate import load_config

TRAIN = [o for o in TINY_OVERRIDES if not o.startswith("model.")] + ["train.eval_every=0", "checkpoint.enabled=false"]
DISTILL = ["train.distill.temperature=2.0", "train.distill.alpha=0.5"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Path:
    """A tiny HF student (seed 0, with its hf-import recipe) and an HF teacher of another seed."""
    root = tmp_path_factory.mktemp("distill")
    save_llama(root / "student")
    hf_import(root / "student", root / "imported")
    save_llama(root / "teacher", seed=1)
    return root


def _overrides(pair: Path, run: Path, cache_dir: Path, *extra: str) -> list[str]:
    return [
        *TRAIN,
        f"data.cache_dir={cache_dir}",
        f"train.run_dir={run}",
        f"train.init_from={pair / 'student'}",
        *extra,
    ]


def test_hf_teacher_distils_like_transformers_by_hand(pair, tmp_path, cache_dir):
    """5 steps distilling an HF teacher into an HF-initialized student: the loss, the grad norm and the KL of
    every step equal transformers' logits and torch AdamW with the KL written out (1e-5)."""
    teacher = pair / "teacher"
    extra = ["train.steps=5", "optim.implementation=for-loop", f"train.distill.teacher={teacher}", *DISTILL]
    config = load_config(str(pair / "imported" / "config.toml"), _overrides(pair, tmp_path / "run", cache_dir, *extra))
    trainer = Trainer(config)
    batches, take = [], trainer._micro_batch

    def recording():
        parts = take()
        batches.append((parts.args[0].clone(), parts.labels.clone()))
        return parts

    trainer._micro_batch = recording
    trainer.fit()
    got, kls = step_records(tmp_path / "run"), []
    want_loss, want_norm = transformers_loop(pair / "student", batches, config.optim, (teacher, 2.0, 0.5), kls)
    assert len(got) == 5 and min(kls) > 0.01  # two different random models: a KL far from zero
    assert_losses_close([r["distill_kl"] for r in got], kls, 1e-5, what="KL")
    assert_losses_close([r["loss"] for r in got], want_loss, 1e-5)
    assert_losses_close([r["grad_norm"] for r in got], want_norm, 1e-5, what="grad norm")


@pytest.mark.parametrize(
    "case,expected",
    [
        ("vocab", "with a vocabulary of 256"),
        ("missing", "does not exist"),
        ("layout", "does not fit the layout: model.n_kv_heads=1 is not divisible by parallel.tp=2"),
    ],
)
def test_bad_teacher_is_one_line_and_writes_nothing(pair, tmp_path, cache_dir, capsys, case, expected):
    """A teacher of another vocabulary, a path that does not exist, a teacher whose heads the student's tensor
    parallelism cannot split: one line naming train.distill.teacher, exit 2, no run directory."""
    teacher, extra = tmp_path / "teacher", []
    if case == "vocab":
        save_llama(teacher, vocab_size=256)
    elif case == "layout":
        save_llama(teacher, num_key_value_heads=1)
        extra = ["parallel.tp=2"]
    run = tmp_path / "run"
    recipe = str(pair / "imported" / "config.toml")
    capsys.readouterr()  # save_pretrained's progress bar
    assert main(["train", recipe, *_overrides(pair, run, cache_dir, f"train.distill.teacher={teacher}", *extra)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err and "train.distill.teacher=" in err, err
    assert not run.exists()
