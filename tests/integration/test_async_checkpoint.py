"""checkpoint.async and checkpoint.every_minutes: training overlaps the write, one save in flight, the
rename only after completion, crash- and preemption-safe, and every rank saves the same step."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from helpers.runs import REPO, torchrun, write_tiny_recipe
from helpers.dist_save_schedule import decide
from torch.distributed.checkpoint._state_dict_stager import StateDictStager

from tessera.api import load
from tessera.train.async_checkpoint import AsyncCheckpointer
from tessera.train.checkpoint import CheckpointError, latest_checkpoint, list_checkpoints
from tessera.train.preemption import PREEMPTION_MARKER
from tessera.train.save_schedule import SaveSchedule
from tessera.train.trainer import Trainer, train

RESUME = ["optim.schedule=constant", "model.dropout=0.1", "log.every=1"]


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_async_run_resumes_bitwise_like_an_uninterrupted_sync_run(tiny_config, tmp_path, monkeypatch):
    sync = train(tiny_config(*RESUME, run_dir=tmp_path / "sync"))
    original_stage = StateDictStager.stage

    def slow_stage(self, *args, **kwargs):  # the copy outlasts the next forward/backward: the optimizer must wait
        time.sleep(0.5)
        return original_stage(self, *args, **kwargs)

    monkeypatch.setattr(StateDictStager, "stage", slow_stage)
    run = tmp_path / "async"
    full = train(tiny_config(*RESUME, "checkpoint.async=true", run_dir=run))
    assert full.losses == sync.losses and [p.name for p in list_checkpoints(run)] == ["step_00000004", "step_00000008"]
    assert _same_weights(load(run), load(tmp_path / "sync"))  # the staged copy is the state of step 8
    meta = json.loads((latest_checkpoint(run) / "meta.json").read_text())
    assert meta["step"] == 8 and meta["loader"]["consumed"] == 32  # JSON part taken at the step, not at commit
    (run / "checkpoints" / "step_00000008").rename(run / "dropped")  # resume from the async step-4 checkpoint
    resumed = train(tiny_config(*RESUME, "checkpoint.async=true", run_dir=run))
    assert resumed.losses == sync.losses[4:]


class _Probe:
    """Holds the writer thread of step 4 until the training loop reached step 6, and records what it saw."""

    def __init__(self, monkeypatch, run_dir) -> None:
        self.run_dir, self.reached_6, self.in_flight, self.max_in_flight = run_dir, threading.Event(), 0, 0
        self.seen: dict[str, object] = {}
        original_write, original_step = dcp.FileSystemWriter.write_data, Trainer.train_step
        probe = self

        def write_data(writer, *args, **kwargs):
            probe.in_flight += 1
            probe.max_in_flight = max(probe.max_in_flight, probe.in_flight)
            if "step_00000004" in str(writer.path) and "overlapped" not in probe.seen:
                probe.seen["overlapped"] = probe.reached_6.wait(timeout=60)
                probe.seen["listed"] = [p.name for p in list_checkpoints(probe.run_dir)]
            try:
                return original_write(writer, *args, **kwargs)
            finally:
                probe.in_flight -= 1

        def train_step(trainer):
            out = original_step(trainer)
            if trainer.step + 1 >= 6:
                probe.reached_6.set()
            return out

        monkeypatch.setattr(dcp.FileSystemWriter, "write_data", write_data)
        monkeypatch.setattr(Trainer, "train_step", train_step)


def test_training_continues_while_the_write_runs_and_one_save_is_in_flight(tiny_config, tmp_path, monkeypatch):
    run = tmp_path / "run"
    probe = _Probe(monkeypatch, run)
    train(tiny_config("checkpoint.async=true", "checkpoint.every=2", "checkpoint.keep_last=10", run_dir=run))
    assert probe.seen["overlapped"], "training did not reach step 6 while step 4 was being written"
    # While step 4 was written, only step 2 existed: the rename happens after the write completed.
    assert probe.seen["listed"] == ["step_00000002"]
    assert probe.max_in_flight == 1  # the step-6 save waited for step 4
    assert [p.name for p in list_checkpoints(run)] == [f"step_{s:08d}" for s in (2, 4, 6, 8)]
    assert not list((run / "checkpoints").glob("*.tmp"))


KILL_DURING_ASYNC_WRITE = textwrap.dedent(
    """
    import os, signal, sys
    import torch.distributed.checkpoint as dcp
    from tessera.validate import load_config
    from tessera.train.trainer import train

    original = dcp.FileSystemWriter.write_data
    def write_data(self, *args, **kwargs):
        result = original(self, *args, **kwargs)  # step 8's shards are on disk; die before metadata and rename
        if "step_00000008" in str(self.path):
            os.kill(os.getpid(), signal.SIGKILL)
        return result
    dcp.FileSystemWriter.write_data = write_data
    train(load_config(sys.argv[1]))
    """
)


def test_crash_mid_write_leaves_the_previous_checkpoint_newest(tiny_config, tmp_path):
    run = tmp_path / "run"
    config = tiny_config(*RESUME, "checkpoint.async=true", run_dir=run)
    recipe, script = tmp_path / "job.toml", tmp_path / "kill.py"
    recipe.write_text(config.to_toml())
    script.write_text(KILL_DURING_ASYNC_WRITE)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(script), str(recipe)], cwd=REPO, capture_output=True, text=True, env=env, check=False
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    partial = run / "checkpoints" / "step_00000008.tmp"
    assert partial.is_dir() and any(partial.iterdir()) and not (partial / "meta.json").exists()
    assert latest_checkpoint(run).name == "step_00000004"
    resumed = train(config)
    reference = train(tiny_config(*RESUME, run_dir=tmp_path / "ref"))
    assert resumed.losses == reference.losses[4:]
    assert latest_checkpoint(run).name == "step_00000008" and not partial.exists()


def test_preemption_waits_for_the_save_in_flight(tiny_config, tmp_path, monkeypatch):
    """SIGTERM arrives while step 4 is being written: the run finishes that write, saves its step, exits."""
    run, waited = tmp_path / "run", threading.Event()
    seen: dict[str, bool] = {}
    original_write, original_wait = dcp.FileSystemWriter.write_data, AsyncCheckpointer.wait

    def write_data(writer, *args, **kwargs):
        if "step_00000004" in str(writer.path) and "waited" not in seen:
            os.kill(os.getpid(), signal.SIGTERM)
            seen["waited"] = waited.wait(timeout=60)  # hold the write until the loop waits for it
        return original_write(writer, *args, **kwargs)

    def wait(self):
        if self.in_flight:
            waited.set()
        return original_wait(self)

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", write_data)
    monkeypatch.setattr(AsyncCheckpointer, "wait", wait)
    result = train(tiny_config("checkpoint.async=true", "train.steps=20", "train.eval_every=0", run_dir=run))
    assert seen["waited"] and result.preempted == "SIGTERM"
    marker = json.loads((run / PREEMPTION_MARKER).read_text())
    stopped = marker["step"]  # 4 when the signal landed before the loop's check at step 4, else a later step
    assert 4 <= stopped < 20 and marker["checkpoint"] == str(latest_checkpoint(run))
    assert [p.name for p in list_checkpoints(run)] == sorted({"step_00000004", f"step_{stopped:08d}"})


def test_every_minutes_saves_by_wall_clock():
    now = [0.0]
    schedule = SaveSchedule(every=100, every_minutes=1.0, total_steps=1000, clock=lambda: now[0])
    now[0] = 59.0
    assert not schedule.due(1)
    now[0] = 61.0
    assert schedule.due(2) and not schedule.due(3)  # a save restarts the clock
    now[0] = 100.0
    assert schedule.due(100) and not SaveSchedule(100, 1.0, 1000, enabled=False).due(100)


def test_every_minutes_is_decided_by_all_ranks_together():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(decide, args=(port, out), nprocs=2, start_method="spawn")  # rank 1 alone would save 2, 4, ..
    results = dict(out.get() for _ in range(2))
    assert results[0] == results[1] == [False, True, False, True, False, True, False, True]


@pytest.mark.slow
def test_async_fsdp_checkpoints_equal_sync_and_every_minutes_saves_the_same_steps(tmp_path, cache_dir):
    recipe = write_tiny_recipe(tmp_path / "base.toml", cache_dir, *RESUME, "parallel.dp_shard=2")
    minutes = ["checkpoint.every=1000", "checkpoint.every_minutes=0.0001", "checkpoint.keep_last=20"]
    variants = {"sync": [], "async": ["checkpoint.async=true"], "minutes": ["checkpoint.async=true", *minutes]}
    torchrun(2, "tests/helpers/dist_variants.py", str(recipe), str(tmp_path), json.dumps(variants))
    assert _same_weights(load(tmp_path / "async"), load(tmp_path / "sync"))
    for step in (4, 8):
        a, s = (
            json.loads((tmp_path / r / f"checkpoints/step_{step:08d}/meta.json").read_text()) for r in ("async", "sync")
        )
        assert a["loader"] == s["loader"] and a["scheduler"] == s["scheduler"]
    # 0.006 s between saves: every step is due by the clock on some rank, and all ranks saved each one.
    assert [p.name for p in list_checkpoints(tmp_path / "minutes")] == [f"step_{s:08d}" for s in range(1, 9)]


def test_a_full_disk_during_a_background_write_is_one_clear_error(tiny_config, tmp_path, monkeypatch):
    original = dcp.FileSystemWriter.write_data

    def write_data(writer, *args, **kwargs):
        if "step_00000008" in str(writer.path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(writer, *args, **kwargs)

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", write_data)
    run, handler = tmp_path / "run", signal.getsignal(signal.SIGTERM)
    with pytest.raises(
        CheckpointError,
        match=r"no space left .* checkpoint step 8 in the background .*MiB are free.*"
        r"newest complete checkpoint is step_00000004",
    ):
        train(tiny_config("checkpoint.async=true", run_dir=run))
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_00000004"]  # the partial .tmp is gone
    assert signal.getsignal(signal.SIGTERM) is handler  # the preemption guard went back despite the error
