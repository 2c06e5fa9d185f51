"""``tessera launch``: the torchrun (or ``accelerate launch``) command that trains a recipe.

One node uses torchrun's standalone rendezvous (a private store on a free port). Several nodes
meet at a c10d rendezvous endpoint (elastic, restartable; node ranks assigned by torchrun) or,
with ``--rdzv-backend static``, at a fixed master address with explicit node ranks. Every
process runs ``python -m tessera train CONFIG OVERRIDES``.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tessera.config import JobConfig
from tessera.errors import ConfigError
from tessera.validate import load_config
from tessera.launcher.common import (
    TORCHRUN_ENV,
    Endpoint,
    LaunchError,
    check_world_size,
    default_nproc_per_node,
    parse_endpoint,
    train_args,
)
from tessera.launcher.workers import run_torchrun
from tessera.plan import warn_if_unfit
from tessera.threads import choose_threads

_ACCELERATE_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


@dataclass
class TorchrunSpec:
    """How many processes, where they meet, and how often a failed group restarts."""

    nnodes: int = 1
    nproc_per_node: int = 1
    rdzv_endpoint: Endpoint | None = None
    rdzv_backend: Literal["c10d", "static"] = "c10d"
    rdzv_id: str = "tessera"
    node_rank: int | None = None
    max_restarts: int = 0
    min_nnodes: int = 0  # elastic: the fewest nodes the job continues on (0 = nnodes, not elastic)

    @property
    def nnodes_flag(self) -> str:
        """torchrun's ``--nnodes`` value: ``N``, or ``MIN:MAX`` when elastic."""
        return (
            f"{self.min_nnodes}:{self.nnodes}"
            if self.min_nnodes and self.min_nnodes < self.nnodes
            else str(self.nnodes)
        )

    @property
    def world_size(self) -> int:
        """Processes in the whole job."""
        return self.nnodes * self.nproc_per_node

    @property
    def standalone(self) -> bool:
        """One node and no endpoint: torchrun's private rendezvous on a free port."""
        return self.nnodes == 1 and self.rdzv_endpoint is None


def make_spec(
    nnodes: int,
    nproc_per_node: int,
    rdzv_endpoint: str | None = None,
    rdzv_backend: str = "c10d",
    rdzv_id: str = "",
    node_rank: int | None = None,
    max_restarts: int = 0,
    run_dir: str = "",
) -> TorchrunSpec:
    """A checked :class:`TorchrunSpec` from command-line values (LaunchError when they cannot work)."""
    if rdzv_backend not in ("c10d", "static"):
        raise LaunchError(f"--rdzv-backend {rdzv_backend!r} is not one of 'c10d', 'static'")
    if max_restarts < 0:
        raise LaunchError(f"--max-restarts must be >= 0, got {max_restarts}")
    endpoint = parse_endpoint(rdzv_endpoint) if rdzv_endpoint else None
    if nnodes > 1 and endpoint is None:
        raise LaunchError(
            f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT, "
            "the address of the first node that every node can reach"
        )
    if rdzv_backend == "c10d" and node_rank is not None:
        raise LaunchError(
            "--node-rank applies to --rdzv-backend static only; the c10d rendezvous assigns node ranks itself"
        )
    if rdzv_backend == "static":
        if endpoint is None:
            raise LaunchError("--rdzv-backend static needs --rdzv-endpoint HOST:PORT (the master: node rank 0)")
        if node_rank is None or not 0 <= node_rank < nnodes:
            raise LaunchError(
                f"--rdzv-backend static needs --node-rank from 0 to {nnodes - 1} (this node's rank), got {node_rank}"
            )
    rdzv = rdzv_id or "tessera-" + (re.sub(r"[^A-Za-z0-9_.-]", "-", Path(run_dir).name) if run_dir else "job")
    backend: Literal["c10d", "static"] = rdzv_backend  # type: ignore[assignment]
    return TorchrunSpec(nnodes, nproc_per_node, endpoint, backend, rdzv, node_rank, max_restarts)


def torchrun_command(spec: TorchrunSpec, config_path: str, overrides: list[str], python: str = "") -> list[str]:
    """The torchrun command line (argv) that starts this node's share of the job.

    torchrun runs as ``PYTHON -m torch.distributed.run`` with this interpreter (or ``python``), so a
    virtual environment works without being activated (its ``bin/`` need not be on PATH).
    """
    cmd = [python or sys.executable, "-m", "torch.distributed.run"]
    if spec.standalone:
        cmd += ["--standalone", "--nnodes=1"]
    elif spec.rdzv_backend == "static":
        assert spec.rdzv_endpoint is not None
        cmd += [
            f"--nnodes={spec.nnodes}",
            f"--node-rank={spec.node_rank}",
            "--rdzv-backend=static",
            f"--master-addr={spec.rdzv_endpoint.host}",
            f"--master-port={spec.rdzv_endpoint.port}",
        ]
    else:
        cmd += [
            f"--nnodes={spec.nnodes_flag}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={spec.rdzv_endpoint}",
            f"--rdzv-id={spec.rdzv_id}",
        ]
    cmd += [f"--nproc-per-node={spec.nproc_per_node}", f"--max-restarts={spec.max_restarts}"]
    return cmd + train_args(config_path, overrides)


def accelerate_config(spec: TorchrunSpec, config: JobConfig) -> str:
    """The ``accelerate launch`` config file (YAML) equivalent to :func:`torchrun_command`."""
    endpoint = spec.rdzv_endpoint
    lines = [
        "# accelerate launch config written by `tessera launch --via accelerate`.",
        "# MULTI_GPU selects accelerate's torchrun launcher; tessera picks nccl or gloo itself,",
        "# so the same file works on CPU-only machines.",
        "compute_environment: LOCAL_MACHINE",
        "distributed_type: MULTI_GPU",
        f"num_machines: {spec.nnodes}",
        f"num_processes: {spec.world_size}",
        f"machine_rank: {spec.node_rank or 0}",
        f"main_process_ip: {endpoint.host if endpoint else '127.0.0.1'}",
        f"main_process_port: {endpoint.port if endpoint else 0}",
        f"rdzv_backend: {'static' if spec.standalone else spec.rdzv_backend}",
        f"same_network: {'true' if spec.rdzv_backend == 'static' else 'false'}",
        "gpu_ids: all",
        f"mixed_precision: '{_ACCELERATE_PRECISION[config.train.dtype]}'",
        "use_cpu: false",
        "main_training_function: main",
        "",
    ]
    return "\n".join(lines)


def accelerate_command(
    spec: TorchrunSpec, yaml_path: str, config_path: str, overrides: list[str], python: str = ""
) -> list[str]:
    """The ``accelerate launch`` command line that uses :func:`accelerate_config`'s file, run by this Python."""
    cmd = [
        python or sys.executable,
        "-m",
        "accelerate.commands.launch",
        f"--config_file={yaml_path}",
        f"--max_restarts={spec.max_restarts}",
    ]
    return cmd + train_args(config_path, overrides)


def runs_on_gpu(config: JobConfig) -> bool:
    """Whether the job's workers use CUDA: ``train.device = "cuda"``, or "auto" on a machine that has it."""
    from tessera.parallel.env import resolve_device

    return resolve_device(config.train.device, require_visible=False).type == "cuda"


def thread_env(config: JobConfig, nproc_per_node: int) -> dict[str, str]:
    """``OMP_NUM_THREADS`` for CPU workers: this node's usable cores / processes, unless already set.

    Without it torchrun gives every worker one thread; GPU workers keep torchrun's default.
    """
    if runs_on_gpu(config) or os.environ.get("OMP_NUM_THREADS"):
        return {}
    return {"OMP_NUM_THREADS": str(choose_threads(config.train.threads, nproc_per_node).threads)}


def parse_nnodes(text: str | int) -> tuple[int, int]:
    """``--nnodes``: ``N`` or ``MIN:MAX`` as (min, max); a LaunchError when it does not parse or is empty."""
    lo, _, hi = str(text).partition(":")
    try:
        low, high = int(lo), int(hi or lo)
    except ValueError:
        raise LaunchError(f"--nnodes {text!r} must be a node count N or an elastic range MIN:MAX, e.g. 2:4") from None
    if not 1 <= low <= high:
        raise LaunchError(f"--nnodes {text!r}: need 1 <= MIN <= MAX")
    return low, high


def check_elastic(config_path: str, overrides: list[str], low: int, high: int, nproc: int) -> list[str]:
    """The overrides plus ``train.elastic_world`` for an elastic range; every size in it must keep the batch."""
    from tessera.train.elastic import resize

    if low == high:
        return overrides
    overrides = [*overrides, f"train.elastic_world={high * nproc}"]
    config = load_config(config_path, overrides)
    for nodes in range(low, high + 1):
        try:
            resized, _ = resize(config, nodes * nproc)
        except ConfigError as err:
            raise LaunchError(f"--nnodes {low}:{high}: at {nodes} node(s): {err}") from None
        check_world_size(resized, nodes, nproc)
    return overrides


def launch(
    config_path: str,
    overrides: list[str],
    nnodes: int | str = 1,
    nproc_per_node: int = 0,
    rdzv_endpoint: str = "",
    rdzv_backend: str = "c10d",
    rdzv_id: str = "",
    node_rank: int | None = None,
    max_restarts: int = 0,
    via: str = "torchrun",
    dry_run: bool = False,
    gpu: str = "",
) -> int:
    """Validate the job, then print the command (``dry_run``) or replace this process with it.

    ``nproc_per_node = 0`` means :func:`default_nproc_per_node`. The command runs with
    :data:`TORCHRUN_ENV` and :func:`thread_env` (printed in front of it, so a copy runs the same).
    ``gpu`` names a GPU kind of the planner's catalog: a layout predicted not to fit it is warned about.
    """
    low, nnodes = parse_nnodes(nnodes)
    nproc = nproc_per_node or default_nproc_per_node()
    overrides = check_elastic(config_path, overrides, low, nnodes, nproc)
    config = load_config(config_path, overrides)
    spec = make_spec(nnodes, nproc, rdzv_endpoint, rdzv_backend, rdzv_id, node_rank, max_restarts, config.train.run_dir)
    if low < nnodes and spec.rdzv_backend == "static":
        raise LaunchError(f"--nnodes {low}:{nnodes} is elastic: it needs --rdzv-backend c10d, not static")
    spec.min_nnodes = low
    check_world_size(config, spec.nnodes, spec.nproc_per_node)
    warn_if_unfit(config, spec.world_size, gpu, spec.nproc_per_node, "gpu" if runs_on_gpu(config) else "cpu")
    if via == "accelerate":
        yaml_path = Path(config.train.run_dir) / "accelerate.yaml"
        yaml_path.parent.mkdir(parents=True, exist_ok=True)
        yaml_path.write_text(accelerate_config(spec, config))
        print(f"wrote {yaml_path}")
        cmd = accelerate_command(spec, str(yaml_path), config_path, overrides)
    else:
        cmd = torchrun_command(spec, config_path, overrides)
    env = {**TORCHRUN_ENV, **thread_env(config, spec.nproc_per_node)}
    print(shlex.join([f"{k}={v}" for k, v in env.items()] + cmd), flush=True)
    if dry_run:
        return 0
    if via != "accelerate":
        return run_torchrun(cmd[3:], env)  # in-process, so a worker's user error ends as one line, exit 2
    os.execve(cmd[0], cmd, {**os.environ, **env})
