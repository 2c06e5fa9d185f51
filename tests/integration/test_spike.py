"""train.on_spike: the robust threshold, warn, and rollback past an injected corrupted batch."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers.runs import REPO
from test_user_errors import fails_with

from tessera.cli import main  # noqa: F401  (fails_with runs it)
from tessera.train.metrics import read_metrics
from tessera.train.spike import SpikeError, SpikeGuard, robust_threshold
from tessera.train.trainer import train

SPIKE_RUN = ["train.steps=20", "train.eval_every=0", "checkpoint.every=5", "train.spike_window=8"]
CORRUPT_STEP = 13  # checkpoint at 10: a rollback skips the batches of steps 11..13


def test_robust_threshold_ignores_one_outlier_and_has_a_floor():
    calm = [5.0, 5.1, 4.9, 5.0, 5.05, 4.95, 5.0, 5.02]
    # One earlier spike in the window barely moves it (a mean + std threshold would jump).
    spiked = calm[:-1] + [50.0]
    assert abs(robust_threshold(spiked, 6.0) - robust_threshold(calm, 6.0)) < 0.2
    assert float(np.mean(spiked) + 6 * np.std(spiked)) > 50.0  # mean + 6 std would now miss a spike to 50
    assert robust_threshold([2.0] * 8, 6.0) == pytest.approx(2.0 * 1.06)  # flat window: the 1% floor


def test_the_guard_waits_for_a_full_window_then_drops_a_spike_and_limits_rollbacks():
    guard = SpikeGuard("rollback", window=5, k=6.0, max_rollbacks=1)
    assert all(guard.judge(s, 100.0 if s == 1 else 5.0 + 0.01 * s, 1.0) for s in range(1, 6))  # window filling
    assert not guard.judge(6, 9.0, 1.0) and guard.pending.metric == "loss"
    record = guard.rolled_back(3, (12, 24))
    assert record["rollback"]["restored_step"] == 3 and [h[0] for h in guard.history] == [1, 2, 3]
    assert guard.judge(4, 5.0, 1.0)  # the window is refilling after the rollback: nothing judged yet
    guard.history.extend([(5, 5.0, 1.0), (6, 5.0, 1.0)])
    assert not guard.judge(7, 5.0, 50.0) and guard.pending.metric == "grad_norm"
    with pytest.raises(SpikeError, match="train.max_rollbacks=1"):
        guard.rolled_back(3, (12, 28))


@pytest.mark.parametrize(
    "override,message",
    [
        ("train.spike_threshold=0.5", "train.spike_threshold must be in [1, 100]"),
        ("train.spike_window=2", "train.spike_window must be in [5, 100000]"),
        ("train.max_rollbacks=0", "train.max_rollbacks must be >= 1"),
        ("train.on_spike=sometimes", "train.on_spike"),
    ],
)
def test_spike_settings_out_of_range_are_one_line(override, message, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    fails_with(["train", "configs/smoke.toml", override, "--print-config"], capsys, message)


def test_rollback_without_checkpoints_is_refused(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    overrides = ["train.on_spike=rollback", "checkpoint.enabled=false", "--print-config"]
    fails_with(["train", "configs/smoke.toml", *overrides], capsys, "checkpoint.enabled=false")


def test_a_corrupted_batch_is_warned_about_or_rolled_back_and_skipped(tiny_config, tmp_path, monkeypatch):
    clean = train(tiny_config(*SPIKE_RUN, "train.on_spike=warn", run_dir=tmp_path / "clean"))
    assert json.loads((tmp_path / "clean" / "summary.json").read_text())["spikes"] == []  # no false alarm

    monkeypatch.setenv("TESSERA_FAULTS", f"corrupt_batch@{CORRUPT_STEP}")
    warned = train(tiny_config(*SPIKE_RUN, "train.on_spike=warn", run_dir=tmp_path / "warn"))
    (spike,) = json.loads((tmp_path / "warn" / "summary.json").read_text())["spikes"]
    assert spike["step"] == CORRUPT_STEP and spike["action"] == "warn" and spike["value"] > spike["threshold"]
    assert warned.losses[: CORRUPT_STEP - 1] == clean.losses[: CORRUPT_STEP - 1]
    assert warned.losses[CORRUPT_STEP - 1] > clean.losses[CORRUPT_STEP - 1]  # trained on the bad batch

    rolled = train(tiny_config(*SPIKE_RUN, "train.on_spike=rollback", run_dir=tmp_path / "rollback"))
    summary = json.loads((tmp_path / "rollback" / "summary.json").read_text())
    (event,) = summary["spikes"]
    batch = 4  # train.batch_size (global)
    assert event["restored_step"] == 10 and event["skipped_samples"] == [10 * batch, CORRUPT_STEP * batch]
    assert summary["steps"] == 20 and len(rolled.losses) == 20
    assert summary["goodput"]["seconds"]["rollback"] > 0  # the restore and the 2 discarded steps
    assert rolled.losses[:10] == clean.losses[:10]  # identical up to the checkpoint it went back to
    assert max(rolled.losses[10:]) < spike["value"] if spike["metric"] == "loss" else True
    records = read_metrics(tmp_path / "rollback")
    assert [r["rollback"]["restored_step"] for r in records if "rollback" in r] == [10]
    assert max(r["step"] for r in records) == 20 and sum(1 for r in records if r.get("step") == 11 and "loss" in r) == 2
    # The bad batch is never seen again: after the rollback no further spike fired (max_rollbacks not needed).
