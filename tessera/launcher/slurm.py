"""``tessera slurm``: a readable sbatch script that trains a recipe on N nodes, and its submission.

The script starts one ``srun`` task per node; each runs torchrun, and the torchruns meet at a
c10d rendezvous on the job's first node (its address read from ``scontrol`` at run time). The
resolved config is copied into the run directory next to the script, so the job trains exactly
what was validated here. Preemption: ``--requeue`` plus a signal ``--signal-seconds`` before the
time limit; the trainer checkpoints on that signal (or on ``scancel --signal=TERM``), leaves
``preempted.json`` in the run directory, and the script requeues the job, which resumes from
the checkpoint (``train.resume = "auto"``).

SLURM's environment variables (``SLURM_JOB_ID``, ``SLURM_JOB_NODELIST``, ...) are read only by
the generated script, at run time, never by tessera's Python code.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tessera.config import JobConfig
from tessera.validate import load_config
from tessera.launcher.common import TORCHRUN_ENV, LaunchError, check_world_size, train_args
from tessera.launcher.torchrun import check_elastic
from tessera.plan import warn_if_unfit
from tessera.train.lock import refuse_if_running
from tessera.train.preemption import PREEMPTED_EXIT_CODE, PREEMPTION_MARKER

SCRIPT_NAME = "job.sbatch"
CONFIG_NAME = "config.toml"
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
_SLURM_OPTION = re.compile(r"^--[a-z][a-z0-9-]*(=\S.*)?$")


@dataclass
class SlurmSpec:
    """The allocation and the per-node launch of a SLURM training job."""

    nodes: int = 1
    gpus_per_node: int = 1  # on a CPU job: processes per node
    device: Literal["auto", "gpu", "cpu"] = "auto"  # auto: see job_device()
    partition: str = ""
    time: str = ""
    account: str = ""
    qos: str = ""
    exclusive: bool = False
    job_name: str = ""
    cpus_per_task: int = 0  # 0: SLURM's default on GPU jobs, one core per process on CPU jobs
    mem: str = ""
    signal_seconds: int = 300
    rdzv_port: int = 0  # 0: 29500 + job id % 1000, so jobs sharing a head node do not collide
    max_restarts: int = 0
    min_nodes: int = 0  # elastic (--nnodes MIN:MAX): the fewest nodes the job runs and continues on; 0 = nodes
    sbatch_options: list[str] = field(default_factory=list)
    setup: list[str] = field(default_factory=list)
    python: str = field(
        default_factory=lambda: sys.executable
    )  # runs torchrun (`PYTHON -m torch.distributed.run`) and training
    gpu: str = ""  # a GPU kind of the planner's catalog: warn when the layout is predicted not to fit it


def time_limit_seconds(text: str) -> int:
    """SLURM's ``--time`` (``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``, ``D-H:M:S``) in seconds."""
    match = _TIME.match(text)
    if not match:
        raise LaunchError(f"--time '{text}' is not a SLURM time limit; write e.g. 30, 04:00:00 or 2-00:00:00")
    days, a, b, c = match.groups()
    nums = [int(x) for x in (a, b, c) if x is not None]
    if days is not None:
        h, m, s = (nums + [0, 0])[:3]
    elif len(nums) == 1:
        h, m, s = 0, nums[0], 0
    elif len(nums) == 2:
        h, m, s = 0, nums[0], nums[1]
    else:
        h, m, s = nums
    return ((int(days or 0) * 24 + h) * 60 + m) * 60 + s


def job_device(requested: str, config: JobConfig) -> Literal["gpu", "cpu"]:
    """``--device``: gpu, cpu, or auto (cpu when train.device=cpu, else gpu).

    The flags describe what the job needs on the compute nodes, never what the machine writing
    the script has (a login node usually has no GPU): a CPU job is asked for with ``--device cpu``.
    """
    if requested in ("gpu", "cpu"):
        return requested  # type: ignore[return-value]
    if requested != "auto":
        raise LaunchError(f"--device {requested!r} is not one of 'auto', 'gpu', 'cpu'")
    return "cpu" if config.train.device == "cpu" else "gpu"


def check_spec(spec: SlurmSpec, config: JobConfig) -> None:
    """Everything about a SLURM request that can be known wrong before submitting it."""
    check_world_size(config, spec.nodes, spec.gpus_per_node)
    if spec.signal_seconds < 1:
        raise LaunchError(f"--signal-seconds must be positive, got {spec.signal_seconds}")
    if spec.time and time_limit_seconds(spec.time) <= spec.signal_seconds:
        raise LaunchError(
            f"--time {spec.time} is not longer than --signal-seconds {spec.signal_seconds}; "
            "the job would be told to stop before it starts"
        )
    if not 0 <= spec.rdzv_port <= 65535:
        raise LaunchError(f"--rdzv-port must be 1-65535 (or 0 for 29500 + job id % 1000), got {spec.rdzv_port}")
    if spec.max_restarts < 0 or spec.cpus_per_task < 0:
        raise LaunchError("--max-restarts and --cpus-per-task must be >= 0")
    for option in spec.sbatch_options:
        if not _SLURM_OPTION.match(option):
            raise LaunchError(
                f"--sbatch '{option}' is not an sbatch option; write it as --name or --name=value, "
                "e.g. --sbatch=--constraint=h100"
            )
    if config.train.resume == "none":
        raise LaunchError(
            "train.resume='none' would restart a requeued job from scratch; use train.resume=auto for SLURM jobs"
        )


def is_elastic(spec: SlurmSpec) -> bool:
    """Whether the job runs on a node range (``--nnodes MIN:MAX``) rather than a fixed count."""
    return 0 < spec.min_nodes < spec.nodes


def elastic_banner(config: JobConfig, spec: SlurmSpec) -> str:
    """The line saying how an elastic job keeps its global batch on fewer nodes ("" when not elastic)."""
    if not is_elastic(spec):
        return ""
    t = config.train
    return (
        f"tessera: elastic: {spec.min_nodes} to {spec.nodes} nodes of {spec.gpus_per_node} processes; on fewer than "
        f"{spec.nodes} nodes train.grad_accum rises (train.elastic_world={t.elastic_world}) to keep the global batch "
        f"of {t.batch_size * t.grad_accum} sequences"
    )


def _sbatch_lines(spec: SlurmSpec, run_dir: str, job_name: str) -> list[str]:
    per_node = spec.gpus_per_node
    cpus = spec.cpus_per_task or (per_node if spec.device == "cpu" else 0)
    nodes = f"{spec.min_nodes}-{spec.nodes}" if is_elastic(spec) else str(spec.nodes)
    lines = [
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1          # one torchrun per node; it starts the processes",
    ]
    if is_elastic(spec):
        lines.append("#SBATCH --no-kill                    # a failed node leaves the others running (elastic)")
    if spec.device == "gpu":
        lines.append(f"#SBATCH --gres=gpu:{per_node}")
    if cpus:
        lines.append(f"#SBATCH --cpus-per-task={cpus}")
    lines += [
        f"#SBATCH --{key}={value}"
        for key, value in (
            ("mem", spec.mem),
            ("partition", spec.partition),
            ("time", spec.time),
            ("account", spec.account),
            ("qos", spec.qos),
        )
        if value
    ]
    if spec.exclusive:
        lines.append("#SBATCH --exclusive")
    lines += [f"#SBATCH {option}" for option in spec.sbatch_options]
    lines += [
        f"#SBATCH --output={run_dir}/logs/slurm-%j.out",
        "#SBATCH --open-mode=append           # a requeued job appends to the same log",
        "#SBATCH --requeue                    # a preempted job goes back into the queue",
        f"#SBATCH --signal=USR1@{spec.signal_seconds}".ljust(37)
        + f"# {spec.signal_seconds} s before the time limit: checkpoint and requeue",
    ]
    return lines


def _environment(spec: SlurmSpec) -> list[str]:
    lines = [
        (f"THREADS=$(( SLURM_CPUS_ON_NODE / {spec.gpus_per_node} )); (( THREADS > 0 )) || THREADS=1", ""),
        (
            "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$THREADS}",
            "torch threads per process: the node's cores / processes",
        ),
        ("export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1", ""),
        *(
            (f"export {key}={value}", "a fresh store per worker group, so restarts work (pytorch#135712)")
            for key, value in TORCHRUN_ENV.items()
        ),
    ]
    if spec.device == "gpu":
        lines += [
            ("export TORCH_NCCL_ASYNC_ERROR_HANDLING=1", "a dead peer fails the job instead of hanging it"),
            ("export NCCL_DEBUG=${NCCL_DEBUG:-WARN}", ""),
            ("# export NCCL_SOCKET_IFNAME=ib0", "uncomment and name your cluster's fabric interface"),
        ]
    return [f"{line.ljust(47)} # {comment}" if comment else line for line, comment in lines]


def _torchrun_args(spec: SlurmSpec) -> list[str]:
    """torchrun on one node, through the job's Python: c10d rendezvous on the first node, signals forwarded."""
    return [
        '"$PYTHON" -m torch.distributed.run',
        f"--nnodes={spec.min_nodes}:{spec.nodes}" if is_elastic(spec) else f"--nnodes={spec.nodes}",
        f"--nproc-per-node={spec.gpus_per_node}",
        "--rdzv-backend=c10d",
        '--rdzv-endpoint="$HEAD_ADDR:$RDZV_PORT"',
        '--rdzv-id="$SLURM_JOB_ID"',
        f"--max-restarts={spec.max_restarts}",
        "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
        f"--shutdown-timeout={spec.signal_seconds}",
        '--log-dir="$RUN_DIR/logs/$SLURM_JOB_ID"',
        "--redirects=3 --tee=3 --local-ranks-filter=0",
        " ".join(train_args('"$RUN_DIR/' + CONFIG_NAME + '"', [])),
    ]


def render_sbatch(config: JobConfig, spec: SlurmSpec, command: str) -> str:
    """The sbatch script for ``config`` on ``spec``; ``command`` is the tessera command that wrote it."""
    run_dir = config.train.run_dir
    job_name = spec.job_name or Path(run_dir).name or "tessera"
    world = spec.nodes * spec.gpus_per_node
    what = f"{spec.gpus_per_node} GPU(s)" if spec.device == "gpu" else f"{spec.gpus_per_node} CPU process(es)"
    port = str(spec.rdzv_port) if spec.rdzv_port else "$((29500 + SLURM_JOB_ID % 1000))"
    body = [
        "#!/bin/bash",
        f"# tessera: {config.model.arch} on {spec.nodes} node(s) x {what} = {world} processes.",
        f"# Written by: {command}",
        f"# Submit from the directory that train.run_dir ({run_dir}) is relative to: sbatch {run_dir}/{SCRIPT_NAME}",
        "# Needs a shared filesystem: every node reads the config and writes checkpoints there.",
        *_sbatch_lines(spec, run_dir, job_name),
        "",
        "set -uo pipefail",
        f"RUN_DIR={shlex.quote(run_dir)}",
        f"PYTHON={shlex.quote(spec.python)}".ljust(47)
        + " # runs torchrun and training: a virtual environment needs no activation",
        "",
        "# The c10d rendezvous lives on the job's first node, at the address SLURM knows it by.",
        'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
        'HEAD_ADDR=$(scontrol show node "$HEAD_NODE" | sed -n "s/.*NodeAddr=\\([^ ]*\\).*/\\1/p")',
        f"RDZV_PORT={port}",
        "",
        *_environment(spec),
        *spec.setup,
        "",
        f'rm -f "$RUN_DIR/{PREEMPTION_MARKER}"',
        (
            'echo "tessera: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST, '
            'rendezvous $HEAD_ADDR:$RDZV_PORT"'
        ),
        "# One task per node, holding all of the node's allocated CPUs (srun would default to one).",
        *_elastic_comment(config, spec),
        f'srun --kill-on-bad-exit={0 if is_elastic(spec) else 1} --cpus-per-task="$SLURM_CPUS_ON_NODE" '
        + " \\\n    ".join(_torchrun_args(spec)),
        "status=$?",
        "",
        (
            f"# The trainer leaves {PREEMPTION_MARKER} (and exits {PREEMPTED_EXIT_CODE}) "
            "after checkpointing on SIGTERM/SIGUSR1."
        ),
        f'if [[ -f "$RUN_DIR/{PREEMPTION_MARKER}" ]]; then',
        f'    echo "tessera: preempted: $(cat "$RUN_DIR/{PREEMPTION_MARKER}"); requeueing job $SLURM_JOB_ID"',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        "exit $status",
        "",
    ]
    return "\n".join(body)


def _elastic_comment(config: JobConfig, spec: SlurmSpec) -> list[str]:
    """Comment lines of an elastic script: what happens when a node is lost."""
    if not is_elastic(spec):
        return []
    return [
        f"# {elastic_banner(config, spec).removeprefix('tessera: ')}.",
        "# A lost node: torchrun's agents meet again (c10d rendezvous, --max-restarts) on the nodes left and",
        "# the trainer resumes from the newest checkpoint, resharded. srun keeps the other tasks running",
        "# (--kill-on-bad-exit=0, --no-kill). The rendezvous lives on the first node: losing it ends the job.",
    ]


def write_job(config: JobConfig, spec: SlurmSpec, command: str) -> Path:
    """Write ``config.toml`` and the sbatch script into the run directory (plus ``logs/``)."""
    run_dir = Path(config.train.run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / CONFIG_NAME).write_text(config.to_toml(), encoding="utf-8")
    script = run_dir / SCRIPT_NAME
    script.write_text(render_sbatch(config, spec, command))
    script.chmod(0o755)
    return script


def submit(script: Path) -> str:
    """``sbatch`` the script; returns the job id."""
    if shutil.which("sbatch") is None:
        raise LaunchError(
            f"sbatch is not installed here; {script} is written: "
            f"submit it from a SLURM login node with: sbatch {script}"
        )
    proc = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
    if proc.returncode != 0:
        reason = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        raise LaunchError(f"sbatch refused {script}: {reason}")
    return proc.stdout.strip().split(";")[0]


def slurm(
    config_path: str,
    overrides: list[str],
    spec: SlurmSpec,
    argv: list[str],
    submit_job: bool = False,
    dry_run: bool = False,
) -> int:
    """Validate, then print the script (``dry_run``), or write it and optionally submit it.

    ``argv`` is the ``tessera`` command line; the script records it (without --submit/--dry-run).
    """
    command = shlex.join(["tessera", *(a for a in argv if a not in ("--submit", "--dry-run"))])
    if spec.min_nodes and not 1 <= spec.min_nodes <= spec.nodes:
        raise LaunchError(f"--nnodes {spec.min_nodes}:{spec.nodes}: need 1 <= MIN <= MAX")
    if is_elastic(spec):  # train.elastic_world, and every node count of the range must keep the batch
        overrides = check_elastic(config_path, overrides, spec.min_nodes, spec.nodes, spec.gpus_per_node)
    config = load_config(config_path, overrides)
    spec = dataclasses.replace(spec, device=job_device(spec.device, config))
    check_spec(spec, config)
    if banner := elastic_banner(config, spec):  # on stderr under --dry-run: stdout is the script
        print(banner, file=sys.stderr if dry_run else sys.stdout, flush=True)
    warn_if_unfit(config, spec.nodes * spec.gpus_per_node, spec.gpu, spec.gpus_per_node, spec.device)
    if dry_run:
        print(render_sbatch(config, spec, command), end="")
        return 0
    refuse_if_running(config.train.run_dir, "this job", trust_heartbeat=True)
    script = write_job(config, spec, command)
    print(f"wrote {script} and {script.parent / CONFIG_NAME}")
    if submit_job:
        print(f"submitted job {submit(script)}")
    else:
        print(f"submit with: sbatch {script}")
    return 0
