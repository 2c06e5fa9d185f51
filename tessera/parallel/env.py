"""The one place that reads the launcher's environment (torchrun / SLURM-started torchrun) and resolves devices."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tessera.errors import ConfigError
from tessera.parallel.collective_log import enable_flight_recorder


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job, as torchrun describes it (defaults: a single process)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1  # processes on this node

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def dist_env() -> DistEnv:
    """RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE of this process (single-process values when unset)."""
    get = os.environ.get
    rank, world, local = int(get("RANK", 0)), int(get("WORLD_SIZE", 1)), int(get("LOCAL_RANK", 0))
    return DistEnv(rank, world, local, int(get("LOCAL_WORLD_SIZE", 1)))


def export_single_process_env() -> None:
    """torchrun's variables for a job of one process started without a launcher, where unset: DeepSpeed reads
    them itself (``LOCAL_RANK`` above all) even when its process group already exists."""
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
        os.environ.setdefault(name, value)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")


def init_distributed(device_type: str) -> DistEnv:
    """Join the process group once (nccl on CUDA, gloo on CPU); a no-op for a single process."""
    env = dist_env()
    if env.is_distributed and not dist.is_initialized():
        if device_type == "cuda":
            torch.cuda.set_device(env.local_rank)
        enable_flight_recorder()  # each rank's last collectives, for the hang report
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    return env


def resolve_device(name: str, require_visible: bool = True) -> torch.device:
    """``train.device`` as a torch device ("auto" prefers CUDA); the one place a device name is resolved.

    ``require_visible``: a CUDA device that this machine cannot see is a ConfigError (False: planning for
    another machine, e.g. the launcher or the planner's measurement).
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if require_visible and name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"train.device={name!r} but no CUDA device is visible; use train.device=cpu")
    return torch.device(name)


def device_for(env: DistEnv, device_type: str) -> torch.device:
    """This rank's device: its local GPU on CUDA, else the CPU."""
    return torch.device("cuda", env.local_rank) if device_type == "cuda" else torch.device("cpu")
