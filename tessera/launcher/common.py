"""What the torchrun and SLURM launchers share: errors, endpoints, world-size checks, the train command."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from tessera.config import ConfigError, JobConfig
from tessera.errors import LaunchError
from tessera.layout import check_layout
from tessera.parallel.dims import ParallelDims


# torchrun's agents share one TCPStore with the workers by default, and a restarted worker group
# can read the dead group's keys from it (agents count restarts separately), then fail to connect
# or hang: pytorch/pytorch#135712. A fresh store per worker group avoids it.
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?)$")


@dataclass(frozen=True)
class Endpoint:
    """A rendezvous endpoint ``host:port`` (IPv6 hosts in brackets: ``[::1]:29400``)."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_endpoint(text: str) -> Endpoint:
    """``host:port`` as an :class:`Endpoint`, or a :class:`LaunchError` saying what is wrong."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not _HOST.match(host):
        raise LaunchError(
            f"--rdzv-endpoint '{text}' does not parse; write HOST:PORT with the first node's address, "
            "e.g. node001:29400 or 10.0.0.1:29400"
        )
    if not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        raise LaunchError(
            f"--rdzv-endpoint '{text}' has port '{port}'; use a number from 1 to 65535, e.g. {host}:29400"
        )
    return Endpoint(host, int(port))


def check_world_size(config: JobConfig, nnodes: int, nproc_per_node: int) -> ParallelDims:
    """The config's parallel degrees for ``nnodes * nproc_per_node`` processes, or a LaunchError."""
    if nnodes < 1 or nproc_per_node < 1:
        raise LaunchError(f"need at least one node and one process per node, got {nnodes} node(s) x {nproc_per_node}")
    world = nnodes * nproc_per_node
    try:
        check_layout(config, world)
        return ParallelDims.from_config(config.parallel, world)
    except ConfigError as err:
        raise LaunchError(
            f"{nnodes} node(s) x {nproc_per_node} process(es) = {world} processes do not fit the config: {err}"
        ) from None


def default_nproc_per_node() -> int:
    """Processes per node when none is given: one per visible GPU, else up to 4 on CPU cores."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return max(1, min(4, len(os.sched_getaffinity(0))))


def train_args(config_path: str, overrides: list[str]) -> list[str]:
    """The arguments after ``python`` that train a recipe: ``-m tessera train CONFIG OVERRIDES``."""
    return ["-m", "tessera", "train", config_path, *overrides]
