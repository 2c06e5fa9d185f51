"""torchft replica groups: a run keeps training through SIGKILLed replicas, which rejoin with live state.

The chaos test launches 2 replica groups (``tessera launch --ft-replicas 2``), SIGKILLs a random one
three times once both train together, and checks: the survivors never restart (one start each per
kill in ft_events.jsonl), no committed step is lost or repeated (every step 1..N once in a
survivor's metrics), every restarted group rejoins from a peer's live state (``healed`` in its
summary; checkpoints are off), and the losses and final weights equal a one-process run's: the
survivors take a dead group's shares of the global batch, so the run is the same computation.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.runs import REPO, run_cli
from test_launch import losses, write_config

FT_JOB = ("train.eval_every=0", "checkpoint.enabled=false", "log.every=1", "train.batch_size=4")
LOSS_RTOL = 1e-5  # per step, against the one-process run (float reassociation only)


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip().endswith("}")]


def _events(run: Path) -> list[dict]:
    path = run / "ft_events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _live_pid(run: Path, group: int) -> int | None:
    starts = [e for e in _events(run) if e["group"] == group and e["event"] == "start"]
    exits = {e["pid"] for e in _events(run) if e["event"] == "exit"}
    return starts[-1]["pid"] if starts and starts[-1]["pid"] not in exits else None


def _both_training(run: Path, since: float) -> float | None:
    """The time of the first step after ``since`` that both groups trained together, once each logged one."""
    firsts = []
    for group in (0, 1):
        together = [r for r in _records(run / f"replica_{group}") if r.get("ft_replicas") == 2 and r["time"] > since]
        if not together:
            return None
        firsts.append(together[0]["time"])
    return max(firsts)


def _kill_three_times(run: Path, launcher: subprocess.Popen, rng: random.Random) -> list[dict]:
    kills: list[dict] = []
    since = 0.0
    deadline = time.time() + 400
    while len(kills) < 3 and time.time() < deadline and launcher.poll() is None:
        joined = _both_training(run, since)
        pids = [_live_pid(run, g) for g in (0, 1)]
        if joined is None or None in pids:
            time.sleep(0.2)
            continue
        if kills:
            kills[-1]["rejoined_s"] = joined - kills[-1]["time"]
        time.sleep(1.0)  # a few steps together
        victim = rng.randrange(2)
        os.kill(pids[victim], signal.SIGKILL)
        since = time.time()
        kills.append({"group": victim, "pid": pids[victim], "survivor": pids[1 - victim], "time": since})
    while kills and launcher.poll() is None and "rejoined_s" not in kills[-1]:
        if (joined := _both_training(run, since)) is not None:
            kills[-1]["rejoined_s"] = joined - kills[-1]["time"]
        time.sleep(0.2)
    return kills


@pytest.mark.slow
def test_a_replica_killed_three_times_costs_no_step_and_no_loss(tiny_config, tmp_path):
    steps = 400
    recipe = write_config(tiny_config, tmp_path / "job.toml", *FT_JOB, f"train.steps={steps}")
    reference = run_cli("train", str(recipe), f"train.run_dir={tmp_path / 'reference'}")
    assert reference.returncode == 0, reference.stderr[-3000:]
    run = tmp_path / "job"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TESSERA_FAULTS": "pace@0.25"}
    cmd = [sys.executable, "-m", "tessera", "launch", str(recipe), "--ft-replicas", "2", "--max-restarts", "3"]
    log = tmp_path / "launch.log"  # a file, not a pipe: nobody reads a pipe while the kills run
    with log.open("w") as sink:
        launcher = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT)
        try:
            kills = _kill_three_times(run, launcher, random.Random(34))
            launcher.wait(timeout=400)
        finally:
            launcher.kill()
    assert launcher.returncode == 0, log.read_text()[-5000:]
    assert len(kills) == 3, f"the run ended before three kills: {kills}"
    _check_survivors(run, kills, steps)
    worst = _check_losses_and_weights(run, tmp_path / "reference", steps)
    summaries = [json.loads((run / f"replica_{g}" / "summary.json").read_text())["fault_tolerance"] for g in (0, 1)]
    alone = sum(1 for r in _records(run / f"replica_{kills[-1]['group'] ^ 1}") if r.get("ft_replicas") == 1)
    # the figures of docs/fault-tolerance.md: rejoined_s is SIGKILL -> the restarted group's first step with its peer
    print(json.dumps({"kills": kills, "worst_loss_rtol": worst, "ft": summaries, "last_survivor_steps_alone": alone}))


def _check_survivors(run: Path, kills: list[dict], steps: int) -> None:
    events = _events(run)
    exits = [e for e in events if e["event"] == "exit" and e["code"] != 0]
    assert sorted(e["pid"] for e in exits) == sorted(k["pid"] for k in kills)  # only the killed ones died
    assert all(e["code"] == -signal.SIGKILL for e in exits)
    for kill in kills:  # the survivor of each kill kept its process and trained every step once
        group = 1 - kill["group"]
        if _live_pid_at_end(events, group) == kill["survivor"]:
            trained = [r["step"] for r in _records(run / f"replica_{group}") if "loss" in r]
            assert trained == list(range(trained[0], steps + 1)), "a survivor lost or repeated a committed step"
    restarted = {k["group"] for k in kills}
    for group in restarted:
        healed = json.loads((run / f"replica_{group}" / "summary.json").read_text())["fault_tolerance"]["healed"]
        assert healed and healed[-1]["step"] > 1, "a restarted group did not receive its peers' live state"


def _live_pid_at_end(events: list[dict], group: int) -> int:
    return [e for e in events if e["group"] == group and e["event"] == "start"][-1]["pid"]


def _all_records(run: Path) -> list[dict]:
    """Every training record of every process of every group (a restarted group's earlier metrics.runK.jsonl)."""
    found = []
    for path in sorted(run.glob("replica_*/metrics*.jsonl")):
        found += [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]
    return [r for r in found if "loss" in r]


def _check_losses_and_weights(run: Path, reference: Path, steps: int) -> float:
    expected = dict(losses(reference))
    records = _all_records(run)
    assert {r["step"] for r in records} == set(range(1, steps + 1)), "a step is missing from every group's metrics"
    worst = max(abs(r["loss"] - expected[r["step"]]) / abs(expected[r["step"]]) for r in records)
    assert worst < LOSS_RTOL, f"losses differ from the one-process run by up to {worst:.2e}"
    want = json.loads((reference / "summary.json").read_text())["param_sumsq"]
    for group in (0, 1):
        got = json.loads((run / f"replica_{group}" / "summary.json").read_text())["param_sumsq"]
        assert got.keys() == want.keys()
        for name, value in want.items():
            assert abs(got[name] - value) <= 1e-4 * abs(value), f"replica {group} weights differ at {name}"
    return worst


@pytest.mark.slow
def test_a_group_dying_inside_a_step_makes_the_survivor_redo_it_over_the_same_samples(tiny_config, tmp_path):
    """Group 1 SIGKILLs itself in a forward (``die`` fault), so group 0's allreduce of that step fails:
    nothing is committed, group 0 redoes the step alone over the same samples (data position rewound,
    both shares taken) and trains on to the end; every step's loss equals a one-process run's."""
    os.environ.setdefault("RUST_LOG", "warn")  # before torchft loads: its lighthouse logs every tick at INFO
    from torchft.coordination import LighthouseServer

    from tessera.launcher.ft import replica_overrides

    steps = 24
    recipe = write_config(tiny_config, tmp_path / "job.toml", *FT_JOB, f"train.steps={steps}")
    reference = run_cli("train", str(recipe), f"train.run_dir={tmp_path / 'reference'}")
    assert reference.returncode == 0, reference.stderr[-3000:]
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=500, heartbeat_timeout_ms=2000)
    run, groups = tmp_path / "job", []
    try:
        for group, faults in ((0, "pace@0.5"), (1, "pace@0.5,die@0:8")):
            argv = replica_overrides([], str(run), group, 2, lighthouse.address())
            env = {**os.environ, "OMP_NUM_THREADS": "1", "TESSERA_FAULTS": faults}
            log = (tmp_path / f"group{group}.log").open("w")
            groups.append(
                subprocess.Popen(
                    [sys.executable, "-m", "tessera", "train", str(recipe), *argv],
                    cwd=REPO,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        assert groups[0].wait(timeout=600) == 0, (tmp_path / "group0.log").read_text()[-5000:]
        assert groups[1].wait(timeout=60) == -signal.SIGKILL
    finally:
        for process in groups:
            process.kill()
        lighthouse.shutdown()
    summary = json.loads((run / "replica_0" / "summary.json").read_text())
    assert summary["fault_tolerance"]["redone_steps"] >= 1, "the step the peer died in was not redone"
    records = _records(run / "replica_0")
    trained = [r["step"] for r in records if "loss" in r]
    assert trained == list(range(trained[0], steps + 1))  # nothing lost, nothing repeated
    if trained[0] > 1:  # group 1 started first and trained alone (min_replicas=1): group 0 healed from it
        assert summary["fault_tolerance"]["healed"], "group 0 joined late without receiving its peer's state"
        early = {r["step"] for r in _records(run / "replica_1") if "loss" in r}
        assert set(range(1, trained[0])) <= early, "a step before group 0 joined is in neither group's metrics"
    assert any(r.get("ft_replicas") == 2 for r in records) and records[-1]["ft_replicas"] == 1
    expected = dict(losses(tmp_path / "reference"))
    for record in (r for r in records if "loss" in r):
        step = record["step"]
        assert record["loss"] == pytest.approx(expected[step], rel=LOSS_RTOL), (step, record, expected[step])


@pytest.mark.parametrize(
    "args,fragment",
    [
        (
            ["--ft-replicas", "4", "train.batch_size=6"],
            "train.batch_size=6 cannot be dealt over parallel.ft.replicas=4",
        ),
        (["--ft-replicas", "2", "parallel.tp=2", "parallel.sequence_parallel=false"], "with tp"),
        (["--ft-replicas", "2", "parallel.dp_shard=2"], "with fsdp"),
        (["--ft-replicas", "2", "--ft-lighthouse", "nowhere"], "--ft-lighthouse='nowhere' is not a lighthouse address"),
        (["--ft-replicas", "-1"], "--ft-replicas must be >= 1"),
    ],
)
def test_fault_tolerant_launches_that_cannot_work_are_one_line(tiny_config, tmp_path, capsys, args, fragment):
    from test_user_errors import fails_with

    recipe = write_config(tiny_config, tmp_path / "job.toml")
    fails_with(["launch", str(recipe), *args, "--dry-run"], capsys, fragment)


def test_a_torchft_train_with_a_bad_lighthouse_is_one_line(tiny_config, tmp_path, capsys):
    from test_user_errors import fails_with

    recipe = write_config(tiny_config, tmp_path / "job.toml")
    ft = ["parallel.fault_tolerance=torchft", "parallel.ft.lighthouse=node7:port"]
    fails_with(["train", str(recipe), *ft], capsys, "parallel.ft.lighthouse='node7:port' is not a lighthouse address")


def test_the_dry_run_prints_one_train_command_per_replica_group(tiny_config, tmp_path, capsys):
    from tessera.cli import main

    recipe = write_config(tiny_config, tmp_path / "job.toml")
    assert main(["launch", str(recipe), "--ft-replicas", "3", "train.batch_size=6", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "3 replica groups" in out
    for group in range(3):
        assert f"parallel.ft.replica_id={group} " in out and f"replica_{group}" in out
