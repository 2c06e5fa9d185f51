"""tessera slurm: the sbatch script, its checks, and real jobs on a local two-node SLURM cluster.

The cluster (slurm/local_cluster.sh: munged, slurmctld, slurmd n1 + n2 on loopback) is started
once per session and stopped at the end, also when a test fails.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers.runs import REPO, run_cli
from test_launch import JOB_OVERRIDES, four_process_losses, free_port, losses, write_config
from tessera.cli import main
from tessera.train.preemption import PREEMPTION_MARKER

CLUSTER_SCRIPT = REPO / "slurm" / "local_cluster.sh"
EXAMPLES = sorted((REPO / "slurm").glob("*.sbatch"))
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def render(capsys, *args: str) -> str:
    """The script ``tessera slurm ARGS --dry-run`` prints."""
    assert main(["slurm", *args, "--dry-run"]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


# ---------------------------------------------------------------- the script, no cluster needed


def test_gpu_script_is_one_torchrun_per_node_with_rendezvous_on_the_first_node(capsys):
    script = render(
        capsys,
        "configs/smoke.toml",
        "--nodes",
        "2",
        "--gpus-per-node",
        "8",
        "--device",
        "gpu",
        "--partition",
        "gpu",
        "--time",
        "04:00:00",
        "--account",
        "proj",
        "--qos",
        "high",
        "--exclusive",
        "--mem",
        "0",
        "--sbatch=--constraint=h100",
    )
    for line in [
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gres=gpu:8",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=04:00:00",
        "#SBATCH --account=proj",
        "#SBATCH --qos=high",
        "#SBATCH --exclusive",
        "#SBATCH --mem=0",
        "#SBATCH --constraint=h100",
        "#SBATCH --requeue",
        "#SBATCH --signal=USR1@300",
        "#SBATCH --output=runs/smoke/logs/slurm-%j.out",
    ]:
        assert line in script.splitlines() or any(l.startswith(line + " ") for l in script.splitlines()), line
    assert 'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)' in script
    assert (
        "--rdzv-backend=c10d" in script
        and '--rdzv-endpoint="$HEAD_ADDR:$RDZV_PORT"' in script
        and "--nproc-per-node=8" in script
    )
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in script and "OMP_NUM_THREADS" in script
    assert "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in script, (
        "torchrun must forward the pre-timeout USR1, not die of it"
    )
    assert '-m tessera train "$RUN_DIR/config.toml"' in script and 'scontrol requeue "$SLURM_JOB_ID"' in script
    assert (
        script.splitlines()[2]
        == "# Written by: tessera slurm configs/smoke.toml --nodes 2 --gpus-per-node 8 --device gpu --partition gpu --time 04:00:00 --account proj --qos high --exclusive --mem 0 --sbatch=--constraint=h100"
    )
    syntax = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr


def test_cpu_script_has_no_gres_and_one_core_per_process(capsys):
    script = render(capsys, "configs/smoke.toml", "--nodes", "2", "--gpus-per-node", "2", "--device", "cpu")
    assert "--gres" not in script and "NCCL" not in script
    assert "#SBATCH --cpus-per-task=2" in script.splitlines() and "--nproc-per-node=2" in script


def test_submit_writes_script_and_config_then_needs_sbatch(tiny_config, tmp_path, monkeypatch, capsys):
    config = write_config(tiny_config, tmp_path / "job.toml")
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    assert (
        main(
            [
                "slurm",
                str(config),
                "--nodes",
                "1",
                "--gpus-per-node",
                "2",
                "--device",
                "cpu",
                "--submit",
                "--train.steps",
                "5",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("tessera: error: sbatch is not installed here") and err.count("\n") == 1
    run_dir = tmp_path / "job"
    assert (run_dir / "job.sbatch").is_file() and (run_dir / "logs").is_dir()
    assert "steps = 5" in (run_dir / "config.toml").read_text()


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--nodes", "2", "--gpus-per-node", "3", "parallel.dp_shard=2"], "6 processes do not fit the config"),
        (["--time", "00:04:00"], "is not longer than --signal-seconds 300"),
        (["--time", "4h"], "is not a SLURM time limit"),
        (["--sbatch", "constraint=h100"], "is not an sbatch option"),
        (["--device", "tpu"], "is not one of"),
        (["train.resume=none"], "would restart a requeued job from scratch"),
    ],
)
def test_impossible_slurm_requests_fail_in_one_line(tiny_config, tmp_path, capsys, flags, fragment):
    config = write_config(tiny_config, tmp_path / "job.toml")
    assert main(["slurm", str(config), "--gpus-per-node", "2", "--device", "cpu", *flags, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1


def test_time_limits_parse_like_slurm():
    from tessera.launcher.slurm import time_limit_seconds

    assert [time_limit_seconds(t) for t in ("30", "5:30", "04:00:00", "2-00", "1-02:03", "1-00:00:05")] == [
        1800,
        330,
        14400,
        172800,
        93780,
        86405,
    ]


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_are_what_the_generator_writes(example, capsys):
    header = next(line for line in example.read_text().splitlines() if line.startswith("# Written by: tessera slurm "))
    args = shlex.split(header.removeprefix("# Written by: tessera "))
    regenerate = f"{header.removeprefix('# Written by: ')} --dry-run > {example.relative_to(REPO)}"
    assert render(capsys, *args[1:]) == example.read_text(), f"slurm/ is out of date; regenerate with: {regenerate}"


def test_examples_cover_one_node_two_nodes_and_llama3_8b_on_64_nodes():
    nodes = {
        int(line.split("=")[1])
        for p in EXAMPLES
        for line in p.read_text().splitlines()
        if line.startswith("#SBATCH --nodes=")
    }
    assert {1, 2} <= nodes
    assert any("configs/llama3-8b.toml --nodes 64" in p.read_text() for p in EXAMPLES)


# ---------------------------------------------------------------- a real cluster


@dataclass
class Cluster:
    """The running local cluster: its state directory and the environment that points at it."""

    state: Path
    env: dict[str, str]

    def run(self, *cmd: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """A SLURM client command against this cluster."""
        return subprocess.run(cmd, capture_output=True, text=True, env=self.env, timeout=timeout)

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Restarts, ...)."""
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(field.split("=", 1) for field in out.split() if "=" in field)

    def wait(self, job_id: str, timeout: float = 300) -> dict[str, str]:
        """Wait until the job reaches a final state; cancel it and fail on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in FINAL_STATES:
                return info
            time.sleep(0.5)
        self.run("scancel", job_id)
        raise AssertionError(f"job {job_id} did not finish within {timeout}s: {self.job(job_id)}")


def _log_tails(state: Path) -> str:
    return "\n".join(
        f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-5:])
        for log in sorted(state.glob("*.log"))
    )


@pytest.fixture(scope="session")
def slurm_cluster():
    """A two-node SLURM cluster on loopback for the whole session (skipped where SLURM cannot run)."""
    missing = [
        tool
        for tool in ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "scontrol")
        if shutil.which(tool) is None
    ]
    if missing:
        pytest.skip(f"no local SLURM cluster: {', '.join(missing)} not installed (apt-get install -y slurm-wlm munge)")
    if os.geteuid() != 0:
        pytest.skip("no local SLURM cluster: slurm/local_cluster.sh runs the daemons as root")
    # Under a 0700 directory (as mktemp -d makes): munged's socket must still be reachable.
    private = Path(tempfile.mkdtemp(prefix="tessera-slurm."))
    state = private / "cluster"
    try:
        started = subprocess.run(
            ["bash", str(CLUSTER_SCRIPT), "start", str(state)], capture_output=True, text=True, timeout=120
        )
        assert started.returncode == 0, f"local SLURM cluster failed to start: {started.stderr}\n{_log_tails(state)}"
        yield Cluster(state, {**os.environ, "OMP_NUM_THREADS": "1", "SLURM_CONF": str(state / "slurm.conf")})
    finally:
        subprocess.run(["bash", str(CLUSTER_SCRIPT), "stop", str(state)], capture_output=True, timeout=180)
        shutil.rmtree(private, ignore_errors=True)


def test_srun_runs_tasks_on_one_and_on_two_nodes(slurm_cluster):
    one = slurm_cluster.run("srun", "--nodes=1", "--ntasks=1", "printenv", "SLURMD_NODENAME")
    assert one.returncode == 0 and one.stdout.split() == ["n1"], one.stderr
    two = slurm_cluster.run("srun", "--nodes=2", "--ntasks-per-node=1", "printenv", "SLURMD_NODENAME")
    assert two.returncode == 0 and sorted(two.stdout.split()) == ["n1", "n2"], two.stderr


def test_sbatch_two_node_job_completes(slurm_cluster, tmp_path):
    script = tmp_path / "hello.sbatch"
    script.write_text(
        f"#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --output={tmp_path}/hello-%j.out\nsrun --ntasks-per-node=1 printenv SLURM_NODEID\n"
    )
    submitted = slurm_cluster.run("sbatch", "--parsable", str(script))
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    assert slurm_cluster.wait(job_id, timeout=60)["JobState"] == "COMPLETED"
    assert sorted((tmp_path / f"hello-{job_id}.out").read_text().split()) == ["0", "1"]


def submit_training(cluster: Cluster, recipe: Path, nodes: int, per_node: int) -> str:
    """``tessera slurm RECIPE --submit`` on the local cluster; returns the job id."""
    flags = [
        "--nodes",
        str(nodes),
        "--gpus-per-node",
        str(per_node),
        "--device",
        "cpu",
        "--rdzv-port",
        str(free_port()),
        "--time",
        "00:20:00",
        "--signal-seconds",
        "60",
    ]
    done = run_cli("slurm", str(recipe), *flags, "--submit", env=cluster.env)
    assert done.returncode == 0, done.stderr
    return done.stdout.split("submitted job ")[1].split()[0]


@pytest.fixture(scope="session")
def four_process_reference(tmp_path_factory, cache_dir) -> list[tuple[int, float]]:
    """The uninterrupted 4-process torchrun losses (computed once, shared with test_launch)."""
    return four_process_losses(tmp_path_factory, cache_dir)


def job_log(run_dir: Path, job_id: str) -> str:
    """The job's SLURM output file (every attempt, appended)."""
    path = run_dir / "logs" / f"slurm-{job_id}.out"
    return path.read_text(errors="replace") if path.is_file() else ""


@pytest.mark.slow
def test_two_node_job_survives_scancel_term_and_matches_a_four_process_torchrun(
    slurm_cluster, tiny_config, tmp_path, four_process_reference
):
    """2 nodes x 2 processes, signalled mid-run: checkpoint, requeue, resume, same losses as torchrun."""
    recipe = write_config(tiny_config, tmp_path / "job.toml", *JOB_OVERRIDES)
    run_dir = tmp_path / "job"
    job_id = submit_training(slurm_cluster, recipe, nodes=2, per_node=2)
    deadline = time.monotonic() + 240
    while len(losses(run_dir)) < 3:
        assert time.monotonic() < deadline and slurm_cluster.job(job_id).get("JobState") in ("PENDING", "RUNNING"), (
            job_log(run_dir, job_id)
        )
        time.sleep(0.1)
    assert slurm_cluster.run("scancel", "--signal=TERM", job_id).returncode == 0
    info = slurm_cluster.wait(job_id, timeout=400)
    log = job_log(run_dir, job_id)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log
    assert "tessera: preempted:" in log and "restart 1" in log and "--nnodes=2" in (run_dir / "job.sbatch").read_text()
    preempted_at = json.loads(log.split("tessera: preempted: ")[1].split("; requeueing")[0])["step"]
    assert 3 <= preempted_at < 60
    assert not (run_dir / PREEMPTION_MARKER).exists()
    assert losses(run_dir) == four_process_reference  # bitwise, fp32 CPU
