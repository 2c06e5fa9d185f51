"""``tessera parity``: the table, the exit code, overrides after --layouts, and a real mismatch."""

from __future__ import annotations

import pytest

from tessera.parity import split_overrides

from helpers.runs import run_cli, write_tiny_recipe


def test_overrides_after_layouts_are_overrides():
    layouts, overrides = split_overrides(["single", "dp_shard=2,tp=2", "optim.warmup_steps=1"], ["model.dim=32"])
    assert layouts == ["single", "dp_shard=2,tp=2"]
    assert overrides == ["model.dim=32", "optim.warmup_steps=1"]


@pytest.mark.slow
def test_parity_command_passes_a_true_layout_and_fails_one_that_differs(tmp_path, cache_dir):
    recipe = write_tiny_recipe(tmp_path / "job.toml", cache_dir, "optim.schedule=constant", "train.steps=40")
    # train.steps=40 with warmup 2; the override after --layouts shortens the run to --steps.
    layouts = ["single", "dp_shard=1,activation_checkpoint=full"]  # one process each: cheap, and equal
    same = run_cli("parity", str(recipe), "--layouts", *layouts, "optim.warmup_steps=1", "--steps", "3")
    assert same.returncode == 0, same.stderr[-2000:]
    assert "grad norm" in same.stdout and "activation_checkpoint=full: max rel diff" in same.stdout
    assert "(ok," in same.stdout
    # MoE's per-rank ("micro") load-balancing loss: two data-parallel ranks truly differ from one.
    moe = ["model.moe.experts=4", "model.moe.aux_loss_coef=0.5", "model.moe.aux_loss_scope=micro"]
    differs = run_cli("parity", str(recipe), "--layouts", "single", "dp_shard=2", *moe, "--steps", "3")
    assert differs.returncode == 1, differs.stderr[-2000:]
    assert "MISMATCH" in differs.stdout
