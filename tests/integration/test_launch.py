"""tessera launch: torchrun/accelerate command lines, checks at the door, and real multi-process runs."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.runs import REPO, TINY_OVERRIDES, run_cli
from tessera.validate import load_config
from tessera.cli import main
from tessera.launcher.common import LaunchError, check_world_size, parse_endpoint
from tessera.launcher.torchrun import accelerate_command, accelerate_config, make_spec, torchrun_command


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(tiny_config, path: Path, *overrides: str) -> Path:
    """A tiny recipe as a TOML file (what users pass to tessera launch/slurm)."""
    path.write_text(tiny_config(*overrides, run_dir=path.with_suffix("")).to_toml())
    return path


def losses(run_dir: Path) -> list[tuple[int, float]]:
    """(step, loss) of every training step in a run's metrics.jsonl (none before it exists)."""
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return [(r["step"], r["loss"]) for r in records if "loss" in r]


def test_standalone_command_runs_tessera_train_with_overrides():
    spec = make_spec(1, 4)
    cmd = torchrun_command(spec, "configs/smoke.toml", ["--train.steps", "5"])
    assert cmd[:4] == [sys.executable, "-m", "torch.distributed.run", "--standalone"]  # this Python: no PATH needed
    assert "--nproc-per-node=4" in cmd and "--max-restarts=0" in cmd
    assert cmd[-6:] == ["-m", "tessera", "train", "configs/smoke.toml", "--train.steps", "5"]


def test_multinode_c10d_and_static_commands():
    c10d = torchrun_command(make_spec(2, 8, "node001:29400", max_restarts=3, run_dir="runs/x y"), "c.toml", [])
    assert "--standalone" not in c10d
    assert {
        "--nnodes=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=node001:29400",
        "--rdzv-id=tessera-x-y",
        "--max-restarts=3",
    } <= set(c10d)
    static = torchrun_command(make_spec(2, 8, "10.0.0.1:29500", "static", node_rank=1), "c.toml", [])
    assert {"--node-rank=1", "--rdzv-backend=static", "--master-addr=10.0.0.1", "--master-port=29500"} <= set(static)


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("node001", "does not parse"),
        (":29400", "does not parse"),
        ("host:port", "has port 'port'"),
        ("host:70000", "has port '70000'"),
        ("bad host:1", "does not parse"),
    ],
)
def test_bad_endpoints_are_rejected(text, fragment):
    with pytest.raises(LaunchError, match=fragment):
        parse_endpoint(text)


def test_endpoints_parse():
    assert (parse_endpoint("[::1]:29400").host, parse_endpoint("[::1]:29400").port) == ("[::1]", 29400)
    assert str(parse_endpoint("n1.cluster:1")) == "n1.cluster:1"


@pytest.mark.parametrize(
    "args, fragment",
    [
        ((2, 4), "needs --rdzv-endpoint"),
        ((2, 4, "h:1", "c10d", "", 1), "--node-rank applies to --rdzv-backend static only"),
        ((2, 4, "h:1", "static", "", 2), "needs --node-rank from 0 to 1"),
        ((1, 4, None, "mpi"), "is not one of"),
        ((1, 4, None, "c10d", "", None, -1), "--max-restarts must be >= 0"),
    ],
)
def test_impossible_launch_requests(args, fragment):
    with pytest.raises(LaunchError, match=fragment):
        make_spec(*args)


def test_world_size_must_fit_the_parallel_degrees(tiny_config):
    assert check_world_size(tiny_config("train.batch_size=12"), 2, 3).dp_shard == 6
    with pytest.raises(LaunchError, match="2 node.* x 2 process.*= 4 processes do not fit"):
        check_world_size(tiny_config("parallel.dp_shard=2"), 2, 2)
    with pytest.raises(LaunchError, match="not divisible"):
        check_world_size(tiny_config("parallel.dp_replicate=2", "parallel.dp_shard=-1"), 1, 3)
    with pytest.raises(
        LaunchError, match=r"train.batch_size=4 \(global\) is not divisible by the data-parallel degree 8"
    ):
        check_world_size(tiny_config(), 2, 4)


def test_cli_errors_are_one_line_and_exit_2(tiny_config, tmp_path, capsys):
    config = write_config(tiny_config, tmp_path / "job.toml", "parallel.dp_shard=2")
    cases = [
        (["--nproc-per-node", "3"], "do not fit the config"),
        (
            ["--nnodes", "2", "--nproc-per-node", "4", "--rdzv-endpoint", "127.0.0.1:29400", "parallel.dp_shard=-1"],
            "train.batch_size=4 (global) is not divisible",
        ),
        (["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", "nohost"], "does not parse"),
    ]
    for flags, fragment in cases:
        assert main(["launch", str(config), *flags, "--dry-run"]) == 2
        err = capsys.readouterr().err
        assert fragment in err and err.startswith("tessera: error:") and err.count("\n") == 1


def test_dry_run_prints_the_validated_command(tiny_config, tmp_path, capsys):
    config = write_config(tiny_config, tmp_path / "job.toml")
    assert main(["launch", str(config), "--nproc-per-node", "2", "--train.steps", "3", "--dry-run"]) == 0
    printed = shlex.split(capsys.readouterr().out.strip())
    assert printed == [
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes=1",
        "--nproc-per-node=2",
        "--max-restarts=0",
        "-m",
        "tessera",
        "train",
        str(config),
        "--train.steps",
        "3",
    ]
    assert main(["launch", str(config), "--train.stepz", "3", "--dry-run"]) == 2
    assert "unknown config key 'train.stepz'" in capsys.readouterr().err


def test_accelerate_config_is_what_accelerate_reads(tiny_config, tmp_path, capsys):
    from accelerate.commands.config.config_args import load_config_from_file

    config = write_config(tiny_config, tmp_path / "job.toml")
    assert (
        main(
            [
                "launch",
                str(config),
                "--nnodes",
                "2",
                "--nproc-per-node",
                "2",
                "--rdzv-endpoint",
                "127.0.0.1:29411",
                "--via",
                "accelerate",
                "--dry-run",
            ]
        )
        == 0
    )
    yaml_path = tmp_path / "job" / "accelerate.yaml"
    loaded = load_config_from_file(str(yaml_path))
    assert (loaded.num_machines, loaded.num_processes, loaded.main_process_ip, loaded.main_process_port) == (
        2,
        4,
        "127.0.0.1",
        29411,
    )
    assert (loaded.rdzv_backend, loaded.same_network, loaded.distributed_type.value) == ("c10d", False, "MULTI_GPU")
    printed = shlex.split(capsys.readouterr().out.splitlines()[-1])
    assert printed[:5] == [
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        f"--config_file={yaml_path}",
    ]
    assert printed[-4:] == ["-m", "tessera", "train", str(config)]


def test_accelerate_single_node_uses_a_free_port():
    spec = make_spec(1, 2)
    from tessera.config import JobConfig

    text = accelerate_config(spec, JobConfig())
    assert "num_processes: 2" in text and "main_process_port: 0" in text and "rdzv_backend: static" in text
    assert accelerate_command(spec, "a.yaml", "c.toml", ["x.y=1"]) == [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file=a.yaml",
        "--max_restarts=0",
        "-m",
        "tessera",
        "train",
        "c.toml",
        "x.y=1",
    ]


# ---------------------------------------------------------------- real multi-process runs

# A constant LR and no periodic eval: where a run is interrupted cannot change its losses.
JOB_OVERRIDES = ("train.steps=60", "optim.schedule=constant", "train.eval_every=0", "checkpoint.every=4")


_REFERENCE: dict[str, list[tuple[int, float]]] = {}
# torchrun and accelerate are not on this PATH (as with an unactivated virtual environment):
# `tessera launch` must start them through its own Python.
NO_LAUNCHERS_ON_PATH = {"PATH": "/usr/bin:/bin"}


def four_process_losses(tmp_path_factory, cache_dir: Path) -> list[tuple[int, float]]:
    """Losses of the JOB_OVERRIDES tiny job run uninterrupted by ``tessera launch --nproc-per-node 4``.

    Run once per session and shared with the SLURM tests (both compare against it).
    """
    if "losses" not in _REFERENCE:
        root = tmp_path_factory.mktemp("reference")
        recipe = root / "job.toml"
        recipe.write_text(
            load_config(
                None, [*TINY_OVERRIDES, f"train.run_dir={root / 'job'}", f"data.cache_dir={cache_dir}", *JOB_OVERRIDES]
            ).to_toml()
        )
        done = run_cli("launch", str(recipe), "--nproc-per-node", "4", env=NO_LAUNCHERS_ON_PATH)
        assert done.returncode == 0, done.stderr[-3000:]
        _REFERENCE["losses"] = losses(root / "job")
    return _REFERENCE["losses"]


@pytest.fixture(scope="session")
def four_process_reference(tmp_path_factory, cache_dir) -> list[tuple[int, float]]:
    """:func:`four_process_losses` as a fixture."""
    return four_process_losses(tmp_path_factory, cache_dir)


def workers_of(agent: subprocess.Popen) -> list[int]:
    """PIDs of the ``tessera train`` processes a torchrun agent has started."""
    children = Path(f"/proc/{agent.pid}/task/{agent.pid}/children")
    pids = [int(p) for p in children.read_text().split()] if children.exists() else []
    return [p for p in pids if b"tessera\x00train" in Path(f"/proc/{p}/cmdline").read_bytes()]


def stop_agents(agents: list[subprocess.Popen]) -> None:
    """Terminate what is still running (agents stop their workers; stragglers are killed by PID)."""
    for agent in agents:
        if agent.poll() is None:
            workers = workers_of(agent)
            agent.terminate()
            try:
                agent.wait(timeout=60)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()
            for pid in workers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_two_agents_on_localhost_train_together_and_restart_after_a_killed_worker(
    tiny_config, tmp_path, four_process_reference
):
    recipe = write_config(tiny_config, tmp_path / "job.toml", *JOB_OVERRIDES)
    run_dir = tmp_path / "job"
    cmd = [
        sys.executable,
        "-m",
        "tessera",
        "launch",
        str(recipe),
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--max-restarts",
        "1",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **NO_LAUNCHERS_ON_PATH}
    logs = [tmp_path / f"agent{i}.log" for i in range(2)]
    agents = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT) for log in logs]
    try:
        deadline = time.monotonic() + 240
        while not ((run_dir / "checkpoints" / "step_00000004").is_dir() and len(losses(run_dir)) >= 6):
            assert time.monotonic() < deadline and all(a.poll() is None for a in agents), logs[0].read_text()[-3000:]
            time.sleep(0.05)
        killed_at = len(losses(run_dir))
        assert killed_at < 60, "the run ended before a worker could be killed"
        os.kill(workers_of(agents[0])[0], signal.SIGKILL)
        codes = [agent.wait(timeout=300) for agent in agents]
    finally:
        stop_agents(agents)
    output = [log.read_text() for log in logs]
    assert codes == [0, 0], output[0][-3000:] + output[1][-3000:]
    assert "exitcode: -9" in output[0], "torchrun should report the killed worker before restarting the group"
    assert losses(run_dir) == four_process_reference  # bitwise: the restarted group resumed from a checkpoint


@pytest.mark.slow
def test_a_user_error_in_a_worker_ends_the_launch_in_one_line_naming_the_rank(tiny_config, tmp_path):
    """The data source is checked in the worker (rank 0 prepares data): its line once, exit 2, no torchrun report."""
    config = write_config(tiny_config, tmp_path / "job.toml", f"data.source={tmp_path / 'missing'}")
    result = run_cli("launch", str(config), "--nproc-per-node", "2", timeout=300)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("tessera: error: rank 0: data source ") and "missing" in lines[0], lines
    assert "ChildFailedError" not in result.stdout + result.stderr
