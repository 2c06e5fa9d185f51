"""Elastic worlds: keep the global batch when a job restarts on fewer ranks than it was set up for.

``train.elastic_world`` (written by ``tessera launch --nnodes MIN:MAX`` and ``tessera slurm
--nodes MIN-MAX`` as MAX nodes x processes per node) is the world size ``train.batch_size`` and
``train.grad_accum`` were chosen for. When torchrun restarts the job on fewer ranks (a node gone
for good), the data-parallel degree drops by a factor ``f``; each rank then keeps its micro-batch
size and the step accumulates ``f`` times as many micro-batches: ``batch_size / f`` global
sequences per micro-batch, ``grad_accum * f`` micro-batches, the same sequences per optimizer step
and, since the loader's position counts global samples, the same samples in the same order. DCP
reshards the checkpoint to the new layout; the loss is the mean over the same tokens, so the
losses equal the full-size run's (to float reassociation).
"""

from __future__ import annotations

import dataclasses

from tessera.config import ConfigError, JobConfig
from tessera.parallel.dims import ParallelDims


def data_parallel_degree(config: JobConfig, world_size: int) -> int:
    """The dp degree of the config's layout at ``world_size`` processes."""
    return ParallelDims.from_config(config.parallel, world_size).dp


def resize(config: JobConfig, world_size: int) -> tuple[JobConfig, str]:
    """``config`` for ``world_size`` processes of a ``train.elastic_world`` job, and its banner ("" unchanged)."""
    full = config.train.elastic_world
    if full == 0 or world_size == full:
        return config, ""
    if world_size > full:
        raise ConfigError(
            f"{world_size} processes exceed train.elastic_world={full} (the batch was set for that many); "
            "raise train.elastic_world or launch fewer"
        )
    factor, why = _factor(config, world_size)
    if why:
        raise ConfigError(why)
    t = config.train
    train = dataclasses.replace(t, batch_size=t.batch_size // factor, grad_accum=t.grad_accum * factor)
    banner = (
        f"tessera: elastic: {world_size} of {full} processes; train.grad_accum {t.grad_accum} -> {train.grad_accum}, "
        f"train.batch_size {t.batch_size} -> {train.batch_size} per micro-batch: the global batch of "
        f"{t.batch_size * t.grad_accum} sequences is kept"
    )
    return dataclasses.replace(config, train=train), banner


def _factor(config: JobConfig, world_size: int) -> tuple[int, str]:
    """(dp shrink factor, "") or (0, why the batch cannot be kept at ``world_size``)."""
    full = config.train.elastic_world
    try:
        dp_full, dp_now = data_parallel_degree(config, full), data_parallel_degree(config, world_size)
    except (ConfigError, ValueError) as err:
        return 0, f"{world_size} processes do not fit the [parallel] layout of train.elastic_world={full}: {err}"
    if dp_full % dp_now or config.train.batch_size % (dp_full // dp_now):
        return 0, (
            f"train.elastic_world={full}: at {world_size} processes data parallelism drops from {dp_full} to {dp_now}, "
            f"which cannot keep the global batch (train.batch_size={config.train.batch_size} must stay divisible "
            f"by the new degree after dividing by {dp_full}/{dp_now}); choose a node range whose sizes divide "
            f"{dp_full}"
        )
    return dp_full // dp_now, ""


def check_range(config: JobConfig, worlds: list[int]) -> None:
    """ConfigError naming the first world size of an elastic range that cannot keep the global batch."""
    for world in worlds:
        resize(config, world)
