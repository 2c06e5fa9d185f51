"""Preemption: a signalled run checkpoints the step it reached, exits 75, and resumes bitwise."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers.runs import REPO
from tessera.train.checkpoint import latest_checkpoint
from tessera.train.preemption import PREEMPTED_EXIT_CODE, PREEMPTION_MARKER, PreemptionGuard
from tessera.train.trainer import train

# Long enough that a signal lands mid-run; a constant LR so nothing depends on where it stops.
PREEMPT_OVERRIDES = ("train.steps=120", "optim.schedule=constant", "train.eval_every=0", "checkpoint.every=1000")


def metrics(run_dir: Path) -> list[dict]:
    """Every record of a run's metrics.jsonl."""
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def wait_for_steps(run_dir: Path, steps: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Block until metrics.jsonl has ``steps`` training steps (fail if the run ends first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum("loss" in r for r in metrics(run_dir)) >= steps:
            return
        assert proc.poll() is None, f"the run ended (rc={proc.returncode}) before step {steps}"
        time.sleep(0.05)
    raise AssertionError(f"no step {steps} within {timeout}s")


def test_guard_records_the_signal_and_restores_handlers(tmp_path):
    previous = signal.getsignal(signal.SIGUSR1)
    (tmp_path / PREEMPTION_MARKER).write_text("{}")
    guard = PreemptionGuard(tmp_path).install()
    try:
        assert not (tmp_path / PREEMPTION_MARKER).exists(), "a stale marker must be cleared when training starts"
        assert not guard.stop_requested(torch.device("cpu"))
        os.kill(os.getpid(), signal.SIGUSR1)
        assert guard.stop_requested(torch.device("cpu")) and guard.reason == "SIGUSR1"
        line = guard.record(7, tmp_path / "ckpt")
    finally:
        guard.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is previous
    assert "SIGUSR1" in line and "step 7" in line and str(PREEMPTED_EXIT_CODE) in line
    assert json.loads((tmp_path / PREEMPTION_MARKER).read_text())["step"] == 7


@pytest.mark.slow
def test_sigterm_checkpoints_exits_75_and_the_rerun_matches_an_uninterrupted_run(tiny_config, tmp_path):
    reference = train(tiny_config(*PREEMPT_OVERRIDES, run_dir=tmp_path / "reference"))
    config = tiny_config(*PREEMPT_OVERRIDES, run_dir=tmp_path / "preempted")
    recipe = tmp_path / "preempted.toml"
    recipe.write_text(config.to_toml())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "tessera", "train", str(recipe)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_steps(tmp_path / "preempted", 3, proc)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == PREEMPTED_EXIT_CODE, output
    run_dir = tmp_path / "preempted"
    marker = json.loads((run_dir / PREEMPTION_MARKER).read_text())
    reached = max(r["step"] for r in metrics(run_dir))
    assert marker["signal"] == "SIGTERM" and marker["step"] == reached < 120
    assert latest_checkpoint(run_dir).name == f"step_{reached:08d}"
    assert not (run_dir / "summary.json").exists(), "a preempted run must not look finished"

    rerun = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert not (run_dir / PREEMPTION_MARKER).exists()
    assert [r["loss"] for r in metrics(run_dir) if "loss" in r] == reference.losses  # bitwise, fp32 CPU
    assert {r["step"]: r["val_loss"] for r in metrics(run_dir) if "val_loss" in r} == reference.val_losses
