"""Elastic restarts: a 4-rank job continuing on 2 ranks keeps the global batch and the losses."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

from pathlib import Path

import pytest

from helpers.runs import REPO, run_cli
from test_launch import losses, write_config
from test_user_errors import fails_with
from tessera.validate import load_config
from tessera.launcher.torchrun import torchrun_command
from tessera.train.checkpoint import list_checkpoints
from tessera.train.elastic import resize

ELASTIC_JOB = ("train.steps=12", "train.eval_every=0", "checkpoint.every=4", "checkpoint.keep_last=5")


def test_a_smaller_world_raises_grad_accum_and_keeps_the_batch(tiny_config):
    config = tiny_config("train.batch_size=8", "train.grad_accum=2", "train.elastic_world=8")
    same, banner = resize(config, 8)
    assert same is config and banner == ""
    half, banner = resize(config, 4)
    assert (half.train.batch_size, half.train.grad_accum) == (4, 4)
    assert "train.grad_accum 2 -> 4" in banner and "global batch of 16 sequences is kept" in banner
    quarter, _ = resize(config, 2)
    assert (quarter.train.batch_size, quarter.train.grad_accum) == (2, 8)


def test_elastic_launch_writes_the_range_and_the_world(tiny_config, tmp_path, capsys):
    from tessera.cli import main

    recipe = write_config(tiny_config, tmp_path / "job.toml")
    args = ["launch", str(recipe), "--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-endpoint", "127.0.0.1:29400"]
    assert main([*args, "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "--nnodes=1:2" in printed and printed.rstrip().endswith("train.elastic_world=4")


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--nnodes", "1:3", "--nproc-per-node", "1", "train.batch_size=4"], "at 1 node(s)"),  # dp 3 -> 1: 4 % 3
        (["--nnodes", "3:2", "--nproc-per-node", "1"], "need 1 <= MIN <= MAX"),
        (["--nnodes", "one:two"], "must be a node count N or an elastic range MIN:MAX"),
        (["--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-backend", "static", "--node-rank", "0"], "elastic"),
    ],
)
def test_elastic_ranges_that_cannot_keep_the_batch_are_one_line(tiny_config, tmp_path, capsys, args, fragment):
    recipe = write_config(tiny_config, tmp_path / "job.toml")
    fails_with(["launch", str(recipe), *args, "--rdzv-endpoint", "127.0.0.1:29400", "--dry-run"], capsys, fragment)


def test_slurm_elastic_script(tiny_config, tmp_path, capsys):
    """`tessera slurm --nnodes 1:2`: a node range, no kill on a node's failure, torchrun's elastic range and
    restarts, train.elastic_world in the copied config, and the grad_accum banner."""
    from tessera.cli import main

    recipe = write_config(tiny_config, tmp_path / "job.toml")
    args = ["slurm", str(recipe), "--nnodes", "1:2", "--gpus-per-node", "2", "--device", "cpu", "--max-restarts", "3"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "elastic: 1 to 2 nodes of 2 processes; on fewer than 2 nodes train.grad_accum rises" in out
    script = (tmp_path / "job" / "job.sbatch").read_text()
    for line in ("#SBATCH --nodes=1-2", "#SBATCH --no-kill", "srun --kill-on-bad-exit=0", "--nnodes=1:2"):
        assert line in script, line
    assert "--rdzv-backend=c10d" in script and "--max-restarts=3" in script
    assert load_config(str(tmp_path / "job" / "config.toml"), []).train.elastic_world == 4
    fixed = main(["slurm", str(recipe), "--nodes", "2", "--gpus-per-node", "2", "--device", "cpu", "--dry-run"])
    script = capsys.readouterr().out
    assert fixed == 0 and "--nnodes=2 \\\n" in script and "--no-kill" not in script
    assert "srun --kill-on-bad-exit=1" in script


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--nnodes", "1:3", "--gpus-per-node", "1", "train.batch_size=4"], "at 1 node(s)"),
        (["--nnodes", "2:1"], "need 1 <= MIN <= MAX"),
        (["--nnodes", "a:b"], "must be a node count N or an elastic range MIN:MAX"),
    ],
)
def test_slurm_elastic_ranges_that_cannot_keep_the_batch_are_one_line(tiny_config, tmp_path, capsys, args, fragment):
    recipe = write_config(tiny_config, tmp_path / "job.toml")
    fails_with(["slurm", str(recipe), *args, "--device", "cpu", "--dry-run"], capsys, fragment)


def test_torchrun_command_keeps_a_plain_node_count():
    from tessera.launcher.torchrun import make_spec

    spec = make_spec(2, 2, "127.0.0.1:29400")
    assert "--nnodes=2" in torchrun_command(spec, "c.toml", [])


@pytest.mark.slow
def test_four_ranks_lose_two_for_good_and_finish_on_two_with_equal_losses(tiny_config, tmp_path):
    recipe = write_config(tiny_config, tmp_path / "job.toml", *ELASTIC_JOB, "train.elastic_world=4")
    full = tmp_path / "job"
    done = run_cli("launch", str(recipe), "--nproc-per-node", "4")
    assert done.returncode == 0, done.stderr[-3000:]
    # Two ranks are gone for good after step 8: the job restarts on the two left (torchrun's elastic agent
    # restarts the survivors with WORLD_SIZE=2; here the restart is run directly) from the step-8 checkpoint.
    shrunk = tmp_path / "shrunk"
    shutil.copytree(full, shrunk)
    for checkpoint in list_checkpoints(shrunk):
        if int(checkpoint.name.removeprefix("step_")) > 8:
            shutil.rmtree(checkpoint)
    (shrunk / "summary.json").unlink()
    again = run_cli("launch", str(recipe), "--nproc-per-node", "2", f"train.run_dir={shrunk}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "elastic: 2 of 4 processes; train.grad_accum 1 -> 2, train.batch_size 4 -> 2" in again.stdout
    reference, resumed = dict(losses(full)), dict(losses(shrunk))
    assert sorted(resumed) == list(range(1, 13))
    for step in range(9, 13):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-5), (step, resumed[step], reference[step])
    assert load_config(str(shrunk / "config.toml"), []).train.grad_accum == 2  # the resolved config says so


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        for child in (task / "children").read_text().split():
            found += [int(child), *_descendants(int(child))]
    return found


def _kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants at once, as a lost node."""
    for victim in [pid, *_descendants(pid)]:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait_for_listener(host: str, port: int, agent: subprocess.Popen) -> None:
    deadline = time.time() + 300
    while time.time() < deadline and agent.poll() is None:
        with socket.socket() as s:
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.2)


@pytest.mark.slow
def test_a_killed_agent_leaves_the_job_to_torchrun_on_the_node_left(tiny_config, tmp_path):
    """Two torchrun agents ("nodes") of an --nnodes 1:2 job on this machine; one agent and its worker are
    SIGKILLed after the step-4 checkpoint. The agent left (it hosts the c10d rendezvous) restarts its worker
    group, the rendezvous closes with one node, and the job finishes at world size 1 with grad_accum doubled:
    losses after the shrink equal a one-process run's at the same global batch."""
    recipe = write_config(tiny_config, tmp_path / "job.toml", *ELASTIC_JOB)
    run = tmp_path / "job"
    reference = run_cli("train", str(recipe), f"train.run_dir={tmp_path / 'reference'}")
    assert reference.returncode == 0, reference.stderr[-3000:]
    # torchrun's agent hosts the c10d store when the endpoint names its own host (127.0.0.1 does not count):
    # this machine's hostname, so the first agent hosts it and the second connects
    host, port = socket.gethostname(), _free_port()
    cmd = [sys.executable, "-m", "tessera", "launch", str(recipe), "--nnodes", "1:2", "--nproc-per-node", "1"]
    cmd += ["--rdzv-endpoint", f"{host}:{port}", "--max-restarts", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TESSERA_FAULTS": "pace@0.5"}
    logs = [tmp_path / "head.log", tmp_path / "other.log"]
    agents = []
    try:
        for log in logs:  # each agent in its own session: killing one kills its worker too, as a lost node
            agents.append(
                subprocess.Popen(
                    cmd, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
                )
            )
            _wait_for_listener(host, port, agents[0])  # the first agent hosts the rendezvous store
        deadline = time.time() + 400
        while not any(int(c.name.removeprefix("step_")) >= 4 for c in list_checkpoints(run)) and time.time() < deadline:
            assert agents[0].poll() is None, logs[0].read_text()[-3000:]
            time.sleep(0.5)
        _kill_tree(agents[1].pid)  # the agent and its worker (torchrun starts workers in their own session)
        agents[0].wait(timeout=400)
    finally:
        for agent in agents:
            if agent.poll() is None:
                _kill_tree(agent.pid)
    out = logs[0].read_text()
    assert agents[0].returncode == 0, out[-5000:]
    assert "elastic: 1 of 2 processes; train.grad_accum 1 -> 2, train.batch_size 4 -> 2" in out, out[-5000:]
    expected, resumed = dict(losses(tmp_path / "reference")), dict(losses(run))
    assert sorted(resumed) == list(range(1, 13))
    for step in resumed:
        assert resumed[step] == pytest.approx(expected[step], rel=1e-5), (step, resumed[step], expected[step])
