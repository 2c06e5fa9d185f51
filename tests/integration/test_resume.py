"""Checkpoints: bitwise-exact resume, crash-safe saves, keep-last-k, safe loading."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

from tessera.api import load
from tessera.train.checkpoint import CheckpointError, Checkpointer, latest_checkpoint, list_checkpoints
from tessera.train.metrics import read_metrics
from tessera.train.trainer import train

from helpers.runs import REPO

# Constant LR after warmup: the schedule does not depend on the run's planned length.
RESUME = ["optim.schedule=constant", "model.dropout=0.1", "log.every=1"]


def _losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def test_resumed_run_is_bitwise_equal_to_uninterrupted(tiny_config, tmp_path):
    full = train(tiny_config(*RESUME, "train.steps=8", run_dir=tmp_path / "full"))
    half = tmp_path / "half"
    train(tiny_config(*RESUME, "train.steps=4", run_dir=half))
    assert [p.name for p in list_checkpoints(half)] == ["step_00000004"]
    resumed = train(tiny_config(*RESUME, "train.steps=8", "train.resume=auto", run_dir=half))
    assert resumed.losses == full.losses[4:]  # exact float equality, step by step
    assert _losses(half) == _losses(tmp_path / "full")
    assert resumed.val_losses[8] == full.val_losses[8]


def test_keep_last_k_and_loadable_api(tiny_config, tmp_path):
    run = tmp_path / "run"
    train(tiny_config("train.steps=8", "checkpoint.every=2", "checkpoint.keep_last=2", run_dir=run))
    assert [p.name for p in list_checkpoints(run)] == ["step_00000006", "step_00000008"]
    model = load(run)
    assert not model.training
    logits = model(torch.randint(0, 512, (1, 8)))
    assert logits.shape == (1, 8, 512)


KILL_DURING_SAVE = textwrap.dedent(
    """
    import os, signal, sys
    import torch.distributed.checkpoint as dcp
    from tessera.validate import load_config
    from tessera.train.trainer import train

    original = dcp.FileSystemWriter.finish
    def finish(self, *args, **kwargs):
        # Shards of step 8 are on disk; die before its metadata and rename.
        if "step_00000008" in str(self.path):
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, *args, **kwargs)
    dcp.FileSystemWriter.finish = finish
    train(load_config(sys.argv[1]))
    """
)


def test_save_killed_half_way_leaves_previous_checkpoint_loadable(tiny_config, tmp_path):
    run = tmp_path / "run"
    config = tiny_config(*RESUME, "train.steps=8", run_dir=run)
    recipe = tmp_path / "job.toml"
    recipe.write_text(config.to_toml())
    script = tmp_path / "kill.py"
    script.write_text(KILL_DURING_SAVE)
    proc = subprocess.run(
        [sys.executable, str(script), str(recipe)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    partial = run / "checkpoints" / "step_00000008.tmp"
    assert partial.is_dir() and any(partial.iterdir())  # the save really was half-way
    assert latest_checkpoint(run).name == "step_00000004"
    load(run)  # the previous checkpoint still loads
    resumed = train(config)  # resume=auto picks step 4 and finishes
    reference = train(tiny_config(*RESUME, "train.steps=8", run_dir=tmp_path / "ref"))
    assert resumed.losses == reference.losses[4:]
    assert latest_checkpoint(run).name == "step_00000008" and not partial.exists()


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_checkpoint_metadata_with_arbitrary_objects_is_refused(tiny_config, tmp_path):
    run = tmp_path / "run"
    train(tiny_config("train.steps=4", run_dir=run))
    ckpt = latest_checkpoint(run)
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Payload()))
    with pytest.raises(CheckpointError, match="unreadable DCP metadata.*tessera does not load"):
        load(run)
    assert not (tmp_path / "pwned").exists() and not (REPO / "pwned").exists()


def test_resume_with_a_different_model_is_a_clear_error(tiny_config, tmp_path):
    run = tmp_path / "run"
    train(tiny_config("train.steps=4", run_dir=run))
    with pytest.raises(CheckpointError, match=r"different \[model\] section"):
        train(tiny_config("train.steps=6", "model.n_layers=3", run_dir=run))


def test_checkpoint_holds_full_state(tiny_config, tmp_path):
    run = tmp_path / "run"
    train(tiny_config("train.steps=4", run_dir=run))
    meta = json.loads((latest_checkpoint(run) / "meta.json").read_text())
    assert meta["step"] == 4 and meta["loader"]["consumed"] == 16
    assert set(meta) >= {"scheduler", "loader", "config", "optim_param_groups"}
    assert Checkpointer(run, 1).root == run / "checkpoints"
