"""Nothing lost: one run per directory, no silent overwrite, clean Ctrl-C, torn metrics, non-finite
numbers, a full disk, finished runs, changed hyper-parameters on resume, and hangs."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from helpers.runs import REPO, TINY_OVERRIDES, write_tiny_recipe
from test_preempt import PREEMPT_OVERRIDES, metrics, wait_for_steps
from tessera.cli import main
from tessera.config import ConfigError
from tessera.hf.convert import hf_export, hf_import
from tessera.train.checkpoint import CheckpointError, latest_checkpoint, list_checkpoints
from tessera.train.guard import HANG_EXIT_CODE, NonFiniteError
from tessera.train.steps import ModelLoss  # every engine's micro-batch loss
from tessera.train.optim import lr_multiplier
from tessera.train.preemption import INTERRUPTED_EXIT_CODE, PREEMPTION_MARKER, PreemptionGuard
from tessera.train.trainer import Trainer, train

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def strict_records(run_dir: Path) -> list[dict]:
    """metrics.jsonl parsed as standard JSON (bare NaN/Infinity are not JSON and fail here)."""

    def refuse(name: str) -> None:
        raise AssertionError(f"metrics.jsonl holds a bare {name}")

    return [json.loads(line, parse_constant=refuse) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def names(run_dir: Path) -> list[str]:
    return [p.name for p in list_checkpoints(run_dir)]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, cache_dir) -> Path:
    """A finished 4-step tiny run (checkpoint at step 4); tests work on copies of it."""
    from tessera.validate import load_config

    run = tmp_path_factory.mktemp("finished") / "run"
    train(load_config(None, [*TINY_OVERRIDES, "train.steps=4", f"train.run_dir={run}", f"data.cache_dir={cache_dir}"]))
    return run


@pytest.fixture
def run_copy(finished, tmp_path) -> Path:
    shutil.copytree(finished, tmp_path / "run")
    return tmp_path / "run"


HOLD_LOCK = "import sys, time; from tessera.train.lock import RunLock; "
HOLD_LOCK += "RunLock(sys.argv[1]).acquire(); print('locked', flush=True); time.sleep(600)"


def test_a_second_training_in_a_run_dir_is_refused_and_a_dead_holder_blocks_nothing(tiny_config, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(run)], stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        assert holder.stdout.readline().strip() == "locked"
        in_use = (
            rf"train.run_dir '{re.escape(str(run))}' belongs to a training that is still running \(pid {holder.pid} "
        )
        with pytest.raises(ConfigError, match=in_use):
            train(tiny_config("train.steps=2", run_dir=run))
        assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()
    finally:
        holder.kill()  # SIGKILL: no cleanup code runs, the kernel drops the lock
        holder.wait()
    assert train(tiny_config("train.steps=2", run_dir=run)).steps == 2


def test_a_fresh_start_over_checkpoints_is_refused_unless_overwrite(run_copy, tiny_config):
    before = (run_copy / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match=r"train.resume=none starts fresh .* up to step_00000004.*train.overwrite"):
        train(tiny_config("train.steps=2", "train.resume=none", run_dir=run_copy))
    assert (run_copy / "metrics.jsonl").read_text() == before and names(run_copy) == ["step_00000004"]
    train(tiny_config("train.steps=2", "train.resume=none", "train.overwrite=true", run_dir=run_copy))
    assert names(run_copy) == ["step_00000002"] and [r["step"] for r in strict_records(run_copy)][-1] == 2
    assert "overwrite = false" in (run_copy / "config.toml").read_text()  # re-running it continues, never deletes


def test_hf_import_into_an_existing_run_is_refused_unless_overwrite(run_copy, tmp_path):
    hf_export(run_copy, tmp_path / "hf")
    with pytest.raises(ConfigError, match="is not empty.*--overwrite"):
        hf_import(tmp_path / "hf", run_copy)
    assert names(run_copy) == ["step_00000004"] and (run_copy / "metrics.jsonl").exists()
    assert hf_import(tmp_path / "hf", run_copy, overwrite=True).name == "step_00000000"
    assert names(run_copy) == ["step_00000000"] and not (run_copy / "metrics.jsonl").exists()


def test_a_crash_mid_write_leaves_nothing_that_breaks_the_resume(run_copy, tiny_config):
    with open(run_copy / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 3.2')  # the crash hit mid-write: no closing brace, no newline
    stale = run_copy / "checkpoints" / "step_00000005.tmp"  # ... and mid-save
    stale.mkdir()
    train(tiny_config("train.steps=6", "checkpoint.every=100", run_dir=run_copy))
    steps = [r["step"] for r in strict_records(run_copy) if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6] and not stale.exists()


def test_a_finished_run_is_left_alone_and_extending_it_adds_to_its_summary(run_copy, tiny_config, capsys):
    summary = (run_copy / "summary.json").read_text()
    records = (run_copy / "metrics.jsonl").read_text()
    assert train(tiny_config("train.steps=4", run_dir=run_copy)).steps == 4
    assert "already complete at step 4 (train.steps=4), so this launch trains 0 steps" in capsys.readouterr().out
    assert (run_copy / "summary.json").read_text() == summary and (run_copy / "metrics.jsonl").read_text() == records
    train(tiny_config("train.steps=8", run_dir=run_copy))
    old, new = json.loads(summary), json.loads((run_copy / "summary.json").read_text())
    assert list(new["val_losses"]) == ["0", "4", "8"] and new["val_losses"]["4"] == old["val_losses"]["4"]
    assert new["steps"] == 8 and new["seconds"] > old["seconds"]


def test_resume_reports_changed_keys_and_the_new_lr_takes_effect(run_copy, tiny_config, capsys):
    with pytest.raises(CheckpointError, match=r"trained with train.seed=1234, not 7; .* depends on the data order"):
        train(tiny_config("train.steps=6", "train.seed=7", run_dir=run_copy))
    config = tiny_config("train.steps=6", "optim.lr=5e-4", "log.progress=lines", run_dir=run_copy)
    train(config)
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("resuming step_00000004 with 3 changed key(s)"))
    assert (
        "optim.lr 0.001 -> 0.0005" in line and "train.steps 4 -> 6" in line and "log.progress 'none' -> 'lines'" in line
    )
    lr = {r["step"]: r["lr"] for r in strict_records(run_copy) if "lr" in r}
    assert lr[5] == pytest.approx(5e-4 * lr_multiplier(4, config.optim, 6), rel=1e-12)


def test_nonfinite_numbers_stop_before_the_update_and_the_save(tiny_config, tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    recipe = write_tiny_recipe(tmp_path / "job.toml", Path(os.environ["TESSERA_CACHE"]), f"train.run_dir={run}")
    monkeypatch.chdir(REPO)
    assert main(["train", str(recipe), "optim.lr=1e3", "optim.grad_clip=0"]) == 2
    err = capsys.readouterr().err.strip()
    match = re.fullmatch(
        r"tessera: error: step (\d+): loss \S+, grad norm \S+ at lr .*stopped before the update.*", err
    )
    assert match and "optim.lr" in err and "optim.eps" in err and "data" in err, err
    stopped = int(match.group(1))
    records = strict_records(run)  # every line standard JSON
    assert max(r["step"] for r in records) == stopped - 1
    assert all(int(name[5:]) < stopped for name in names(run))
    for ckpt in list_checkpoints(run):
        assert all(torch.isfinite(p).all() for p in _weights(ckpt))


def _weights(ckpt: Path) -> list[torch.Tensor]:
    from tessera.api import load

    return list(load(ckpt).state_dict().values())


def _nan_loss_on(monkeypatch, steps: set[int]) -> None:
    """Make the training loss NaN on the given optimizer steps (1-based; evaluation untouched)."""
    real = ModelLoss.__call__
    calls = {"n": 0}

    def loss_with_nans(*args, **kwargs):
        loss = real(*args, **kwargs)
        if torch.is_grad_enabled():
            calls["n"] += 1
            if calls["n"] in steps:
                return loss * float("nan")
        return loss

    monkeypatch.setattr(ModelLoss, "__call__", loss_with_nans)


def test_skip_leaves_weights_and_schedule_alone_and_stops_after_n_in_a_row(tiny_config, monkeypatch):
    trainer = Trainer(tiny_config("train.on_nonfinite=skip", "train.max_nonfinite_skips=2"))
    try:
        _nan_loss_on(monkeypatch, {2, 4, 5})
        trainer.train_step()
        before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        epoch = trainer.scheduler.last_epoch
        assert math.isnan(trainer.train_step()["loss"]) and trainer.nonfinite.skipped == 1
        assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
        assert trainer.scheduler.last_epoch == epoch
        assert math.isfinite(trainer.train_step()["loss"]) and trainer.nonfinite.in_a_row == 0
        trainer.train_step()
        with pytest.raises(NonFiniteError, match=r"2 steps in a row were non-finite and skipped"):
            trainer.train_step()
    finally:
        trainer.close()
        trainer.data.train.close()


def test_a_skipped_step_is_logged_as_json_null(tiny_config, tmp_path, monkeypatch):
    run = tmp_path / "run"
    _nan_loss_on(monkeypatch, {3})
    train(tiny_config("train.steps=4", "train.on_nonfinite=skip", run_dir=run))
    step3 = next(r for r in strict_records(run) if r["step"] == 3 and "loss" in r)
    assert step3["loss"] is None and step3["skipped_steps"] == 1
    assert names(run) == ["step_00000004"]


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _unshare_works(), reason="needs a private mount namespace (unshare -rm) for a small tmpfs")
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_full_disk_during_a_checkpoint_is_one_line_and_leaves_no_tmp(tmp_path, cache_dir, mode):
    disk = tmp_path / "disk"
    disk.mkdir()
    async_save = f"checkpoint.async={str(mode == 'async').lower()}"
    recipe = write_tiny_recipe(tmp_path / "job.toml", cache_dir, f"train.run_dir={disk / 'run'}", async_save)
    script = (
        f"mount -t tmpfs -o size=3m tmpfs {disk} && {sys.executable} -m tessera train {recipe}; "
        f"echo rc=$?; ls -a {disk / 'run' / 'checkpoints'}"
    )
    result = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, env=ENV, cwd=REPO)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tessera: error: no space left on the device"), result.stderr
    assert "checkpoint step 8" in lines[0] and "MiB are free" in lines[0] and "step_00000004" in lines[0]
    assert "rc=2" in result.stdout
    assert result.stdout.split("rc=2")[1].split() == [".", "..", "step_00000004"]  # the partial .tmp is gone


def test_the_hang_watchdog_dumps_stacks_and_exits(tmp_path):
    script = textwrap.dedent(
        f"""
        import time
        from tessera.train.guard import HangWatchdog
        with HangWatchdog({str(tmp_path)!r}, 3, 2.0, grace_s=0.0) as watchdog:
            for step in range(1, 6):  # progress within the timeout: nothing happens
                time.sleep(0.5)
                watchdog.kick(step)
            print("kicked through", flush=True)
            def stalled_collective():
                time.sleep(60)
            stalled_collective()
        """
    )
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=ENV, timeout=60)
    assert result.returncode == HANG_EXIT_CODE and time.monotonic() - started < 30
    assert result.stdout == "kicked through\n"
    dump = (tmp_path / "hang" / "rank_3.txt").read_text()
    assert dump.startswith("rank 3 (pid ") and "after step 5" in dump and "stalled_collective" in dump
    assert result.stderr.count("\n") == 1 and "rank 3 made no progress" in result.stderr


HANG_RUN = textwrap.dedent(
    """
    import sys, time
    from tessera.validate import load_config
    from tessera.train import trainer

    original = trainer.Trainer.train_step
    def train_step(self):
        if self.parallel.env.rank == 1 and self.step == 2:
            time.sleep(600)  # this rank stalls; rank 0 blocks in the step's next collective
        return original(self)
    trainer.Trainer.train_step = train_step
    trainer.train_and_exit(load_config(sys.argv[1]))
    """
)


@pytest.mark.slow
def test_a_stalled_rank_makes_every_rank_dump_its_stacks_and_exit(tmp_path, cache_dir):
    run = tmp_path / "run"
    recipe = write_tiny_recipe(
        tmp_path / "job.toml", cache_dir, f"train.run_dir={run}", "train.hang_timeout_s=10", "train.eval_every=0"
    )
    script = tmp_path / "hang_run.py"
    script.write_text(HANG_RUN)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(script),
        str(recipe),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=REPO, timeout=600)
    assert result.returncode != 0
    stalled, waiting = (run / "hang" / "rank_1.txt").read_text(), (run / "hang" / "rank_0.txt").read_text()
    assert "after step 2" in stalled and "in train_step" in stalled
    assert "after step 2" in waiting and "in train_step" in waiting
    assert "made no progress" in result.stderr


@pytest.mark.slow
def test_a_finished_run_launched_under_another_layout_says_why_it_trains_nothing(run_copy):
    summary = (run_copy / "summary.json").read_text()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "tessera"]
    cmd += ["train", str(run_copy / "config.toml"), "parallel.dp_shard=2"]
    result = subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("already complete at step 4 (train.steps=4), so this launch trains 0 steps") == 1
    assert (run_copy / "summary.json").read_text() == summary


SLOW_SAVE = textwrap.dedent(
    """
    import sys, time
    from tessera.cli import main
    from tessera.train.checkpoint import Checkpointer

    original = Checkpointer.save
    def save(self, *args, **kwargs):
        time.sleep(3)  # a big model's save: long enough for a second Ctrl-C to land in it
        return original(self, *args, **kwargs)
    Checkpointer.save = save
    sys.exit(main(sys.argv[1:]))
    """
)


SLOW_BACKGROUND_WRITE = textwrap.dedent(
    """
    import sys, time
    import torch.distributed.checkpoint as dcp
    from tessera.cli import main

    original = dcp.FileSystemWriter.write_data
    def write_data(self, *args, **kwargs):
        time.sleep(60)  # a slow disk under checkpoint.async: the writer thread is busy long after Ctrl-C
        return original(self, *args, **kwargs)
    dcp.FileSystemWriter.write_data = write_data
    sys.exit(main(sys.argv[1:]))
    """
)


def _signal_run(
    tiny_config, tmp_path, signals: int, script: str = SLOW_SAVE, *overrides: str
) -> tuple[subprocess.Popen, str, Path]:
    run = tmp_path / "run"
    recipe = tmp_path / "job.toml"
    recipe.write_text(tiny_config(*PREEMPT_OVERRIDES, *overrides, run_dir=run).to_toml())
    cmd = [sys.executable, "-c", script, "train", str(recipe)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_steps(run, 3, proc)
        signalled_at = time.monotonic() + (signals - 1) * 1.0
        for _ in range(signals):
            proc.send_signal(signal.SIGINT)
            time.sleep(1.0)
        output, _ = proc.communicate(timeout=120)
        proc.after_last_signal_s = time.monotonic() - signalled_at  # type: ignore[attr-defined]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc, output, run


def test_a_sigint_echo_within_the_window_is_not_a_second_ctrl_c(tmp_path):
    guard = PreemptionGuard(tmp_path, echo_s=60.0).install()
    try:
        try:
            os.kill(os.getpid(), signal.SIGINT)  # the terminal's Ctrl-C ...
            os.kill(os.getpid(), signal.SIGINT)  # ... and torchrun forwarding it: one Ctrl-C
        except KeyboardInterrupt:
            pytest.fail("the echo of one Ctrl-C aborted the run")
        assert guard.stop_requested(torch.device("cpu")) and guard.interrupted
    finally:
        guard.uninstall()
    guard = PreemptionGuard(tmp_path).install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        guard.uninstall()


@pytest.mark.slow
def test_ctrl_c_finishes_the_step_saves_and_exits_130(tiny_config, tmp_path):
    proc, output, run = _signal_run(tiny_config, tmp_path, 1)
    assert proc.returncode == INTERRUPTED_EXIT_CODE, output
    assert "Traceback" not in output and "interrupted by SIGINT: saved step" in output
    reached = max(r["step"] for r in metrics(run))
    assert latest_checkpoint(run).name == f"step_{reached:08d}" and reached < 120
    assert not (run / PREEMPTION_MARKER).exists(), "a Ctrl-C must not requeue the job"


@pytest.mark.slow
def test_a_second_ctrl_c_aborts_at_once(tiny_config, tmp_path):
    proc, output, run = _signal_run(tiny_config, tmp_path, 2)
    assert proc.returncode == INTERRUPTED_EXIT_CODE, output
    assert "Traceback" not in output and output.strip().endswith("tessera: interrupted")
    assert "saved step" not in output and latest_checkpoint(run) is None


@pytest.mark.slow
def test_a_second_ctrl_c_during_a_background_write_aborts_at_once_and_commits_nothing(tiny_config, tmp_path):
    proc, output, run = _signal_run(tiny_config, tmp_path, 2, SLOW_BACKGROUND_WRITE, "checkpoint.async=true")
    assert proc.returncode == INTERRUPTED_EXIT_CODE, output
    assert "Traceback" not in output and output.strip().endswith("tessera: interrupted"), output
    assert proc.after_last_signal_s < 30, f"exited {proc.after_last_signal_s:.0f} s after the second Ctrl-C"
    assert "saved step" not in output and latest_checkpoint(run) is None  # the abandoned write is not committed
