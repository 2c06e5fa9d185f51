"""``tessera launch --via accelerate`` really launches: two ranks train and match one process."""

from __future__ import annotations

import sys

import pytest

from tessera.validate import load_config
from tessera.train.trainer import train

from helpers.runs import assert_runs_match, run_cli, write_tiny_recipe


@pytest.mark.slow
def test_accelerate_launch_trains_two_ranks_that_match_one_process(tmp_path, cache_dir):
    job = [
        "train.steps=4",
        "train.batch_size=8",
        "optim.schedule=constant",
        "train.eval_every=0",
        "checkpoint.enabled=false",
    ]
    recipe = write_tiny_recipe(tmp_path / "job.toml", cache_dir, *job)
    reference = train(load_config(recipe, [f"train.run_dir={tmp_path}/single"])).run_dir
    launched = run_cli(
        "launch",
        str(recipe),
        "--via",
        "accelerate",
        "--nproc-per-node",
        "2",
        f"train.run_dir={tmp_path}/acc",
        "log.progress=lines",
        env={"PATH": "/usr/bin:/bin"},  # no `accelerate` on PATH: launched through this Python
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert f"{sys.executable} -m accelerate.commands.launch" in launched.stdout
    assert (tmp_path / "acc" / "accelerate.yaml").is_file()
    assert "2 processes, dp=2" in launched.stdout + launched.stderr  # the banner of a real 2-rank job
    assert assert_runs_match(tmp_path / "acc", reference) == 4
