"""torchft replica groups: the lighthouse address, which shares of the global batch a replica takes, the Manager.

Under ``parallel.fault_tolerance = "torchft"`` every replica group is one process holding the whole
model (a DDP replica; the fault domain). torchft's lighthouse forms a quorum of the live groups
before each step; gradients are averaged over the groups in it (``Manager.allreduce``, a
reconfigurable gloo/NCCL process group), and a group that joins late receives the live weights,
optimizer, schedule and data position from a peer (torchft's checkpoint transport over HTTP),
never from a checkpoint file.

The global batch is dealt in ``parallel.ft.replicas`` equal shares ("slots") whatever the quorum:
with ``n`` groups alive, the group of quorum rank ``r`` takes slots ``r, r + n, r + 2n, ...`` and
weights each by ``n / replicas``, so the average over the ``n`` groups is the mean over all slots:
the same samples and the same gradient as the full run, at ``replicas / n`` times the work.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from tessera.config import ParallelConfig, TrainConfig
from tessera.config.checks import require
from tessera.errors import ConfigError
from tessera.parallel.loss import MicroBatch

_ADDRESS = re.compile(r"^(?:http://)?(\[[0-9A-Fa-f:]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"


def lighthouse_url(address: str, key: str = "parallel.ft.lighthouse") -> str:
    """``http://HOST:PORT`` from ``HOST:PORT`` or ``http://HOST:PORT`` (ConfigError naming ``key`` otherwise)."""
    match = _ADDRESS.match(address.strip())
    if match is None or not 0 < int(match.group(2)) < 65536:
        raise ConfigError(
            f"{key}={address!r} is not a lighthouse address; give HOST:PORT or http://HOST:PORT "
            "(what `torchft_lighthouse --bind` or `tessera launch --ft-replicas` prints)"
        )
    return f"http://{match.group(1)}:{match.group(2)}"


def check_fault_tolerance(p: ParallelConfig, t: TrainConfig) -> None:
    """The [parallel.ft] rules (the layouts torchft refuses are in the compatibility table)."""
    if p.fault_tolerance == "none":
        return
    require(
        importlib.util.find_spec("torchft") is not None,
        "parallel.fault_tolerance='torchft' needs torchft, which the base install leaves out: pip install -e '.[ft]'",
    )
    ft = p.ft
    require(ft.replicas >= 1, f"parallel.ft.replicas must be >= 1, got {ft.replicas}")
    require(
        0 <= ft.replica_id < ft.replicas,
        f"parallel.ft.replica_id={ft.replica_id} must be in 0..{ft.replicas - 1} (parallel.ft.replicas={ft.replicas})",
    )
    require(
        1 <= ft.min_replicas <= ft.replicas,
        f"parallel.ft.min_replicas={ft.min_replicas} must be in 1..parallel.ft.replicas={ft.replicas}",
    )
    require(ft.timeout_s > 0, f"parallel.ft.timeout_s must be > 0, got {ft.timeout_s}")
    require(
        t.batch_size % ft.replicas == 0,
        f"train.batch_size={t.batch_size} cannot be dealt over parallel.ft.replicas={ft.replicas} replica groups "
        f"(each takes an equal share of the global batch); make train.batch_size a multiple of {ft.replicas}",
    )
    require(
        t.on_spike != "rollback",
        "train.on_spike='rollback' restores a checkpoint on one replica group only; with "
        "parallel.fault_tolerance='torchft' use train.on_spike='warn' or 'off'",
    )
    address = ft.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "")
    if not address:
        raise ConfigError(
            "parallel.fault_tolerance='torchft' needs parallel.ft.lighthouse=HOST:PORT (or $TORCHFT_LIGHTHOUSE); "
            "`tessera launch --ft-replicas N` starts a lighthouse and sets it"
        )
    lighthouse_url(address, "parallel.ft.lighthouse" if ft.lighthouse else f"${LIGHTHOUSE_ENV}")


def my_slots(replicas: int, participants: int, rank: int | None) -> list[int]:
    """The shares of the global batch the group of quorum rank ``rank`` takes (none when it sits out)."""
    if rank is None or participants < 1:
        return []
    return list(range(rank, replicas, participants))


def slot_rows(batch: MicroBatch, slot: int, replicas: int) -> MicroBatch:
    """Rows ``slot`` of ``replicas`` equal shares of a global micro-batch (every tensor split on dim 0)."""
    rows = batch.labels.shape[0]
    size = rows // replicas

    def take(t: Any) -> Any:
        is_rows = isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == rows
        return t[slot * size : (slot + 1) * size] if is_rows else t

    kwargs = {k: take(v) for k, v in batch.kwargs.items()}
    return MicroBatch(tuple(take(a) for a in batch.args), kwargs, take(batch.labels), take(batch.loss_mask))


@dataclass
class ReplicaState:
    """What a joining replica group receives from a peer: ``get`` builds it, ``put`` applies it."""

    get: Callable[[], dict[str, Any]]
    put: Callable[[dict[str, Any]], None]


def build_manager(p: ParallelConfig, state: ReplicaState) -> tuple[Any, Any]:
    """(torchft's Manager, the TCPStore it needs alive) for this process's replica group: a world of one
    (its own TCPStore), a gloo group that each quorum reconfigures; tessera seeds every replica identically,
    so step 0 needs no weight sync."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at INFO otherwise
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    logging.getLogger("torchft.manager").setLevel(logging.ERROR)  # its per-quorum NCCL flight-recorder warning

    ft = p.ft
    timeout = timedelta(seconds=ft.timeout_s)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=state.put,
        state_dict=state.get,
        min_replica_size=ft.min_replicas,
        use_async_quorum=False,  # heal before the forward: the step then runs on the received weights
        timeout=timeout,
        quorum_timeout=timeout * 3,
        connect_timeout=timeout,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=lighthouse_url(ft.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "")),
        replica_id=f"tessera_replica_{ft.replica_id}",
        init_sync=False,
    ), store
