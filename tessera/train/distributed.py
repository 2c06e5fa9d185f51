"""The trainer's view of the parallel job: ranks, mesh, device, reductions for metrics."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from tessera.config import ConfigError, JobConfig
from tessera.layout import check_layout
from tessera.parallel import ParallelDims, parallelize, uses_fsdp
from tessera.parallel.context import loss_scale, shard_batch
from tessera.parallel.env import DistEnv, device_for, init_distributed
from tessera.parallel.pipeline import HeadLoss, LossFn, Pipeline, build_pipeline


@dataclass
class ParallelContext:
    """Process-group membership and the mesh of one training process."""

    env: DistEnv
    dims: ParallelDims
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Rank 0 logs, writes run files and renames checkpoints."""
        return self.env.rank == 0

    @property
    def dp_rank(self) -> int:
        mesh = self.dims.submesh("dp")
        return mesh.get_local_rank() if mesh is not None else 0

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def tp_enabled(self) -> bool:
        return self.dims.tp > 1

    def loss_context(self) -> contextlib.AbstractContextManager:
        """``loss_parallel`` when the head's logits are vocab-sharded (tensor parallelism)."""
        return loss_parallel() if self.tp_enabled else contextlib.nullcontext()

    @property
    def cp_mesh(self):
        """The context-parallel mesh (None without context parallelism)."""
        return self.dims.submesh("cp")

    def split_batch(
        self,
        args: tuple[torch.Tensor, ...],
        kwargs: dict[str, Any],
        labels: torch.Tensor,
        loss_mask: torch.Tensor | None,
    ) -> tuple[tuple[torch.Tensor, ...], dict[str, Any], torch.Tensor, torch.Tensor | None]:
        """This rank's slice of every sequence of a batch under context parallelism, else the batch."""
        if self.cp_mesh is None:
            return args, kwargs, labels, loss_mask
        return shard_batch(args, kwargs, labels, loss_mask, self.cp_mesh)

    def loss_scale(self, labels: torch.Tensor, loss_mask: torch.Tensor | None) -> float:
        """Factor on this rank's mean token loss: 1, or under context parallelism cp * local / global
        tokens (its share of the batch loss, for FSDP's average over dp_shard x cp)."""
        return 1.0 if self.cp_mesh is None else loss_scale(labels, loss_mask, self.cp_mesh)

    def mean_over_dp(self, value: torch.Tensor) -> torch.Tensor:
        """Average a per-rank scalar tensor over the data-parallel (and context-parallel) ranks (no host sync)."""
        mesh = self.dims.submesh("dp_cp") or self.dims.submesh("dp")
        if mesh is None:
            return value
        t = value.detach().clone().reshape(1)
        dist.all_reduce(t, group=mesh.get_group())
        return t[0] / mesh.size()

    def sum_over_dp(self, values: list[float]) -> list[float]:
        """Sum per-rank numbers over the data-parallel (and context-parallel) ranks."""
        mesh = self.dims.submesh("dp_cp") or self.dims.submesh("dp")
        if mesh is None:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=mesh.get_group())
        return t.tolist()

    def sum_over_pp(self, values: list[float]) -> list[float]:
        """Sum per-rank numbers over the pipeline ranks (what only the last stage measured reaches rank 0)."""
        mesh = self.pp_mesh
        if mesh is None:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=mesh.get_group())
        return t.tolist()

    def barrier(self) -> None:
        """Wait for every rank (no-op for one process)."""
        if self.env.is_distributed:
            dist.barrier()

    def parallelize(self, model: nn.Module, config: JobConfig, frozen: bool = False) -> nn.Module:
        """Apply the configured layout (see :func:`tessera.parallel.parallelize`; ``frozen``: a teacher)."""
        return parallelize(model, self.dims, config, self.device.type, frozen)

    def pipeline(
        self, model: nn.Module, config: JobConfig, loss_fn: LossFn, head_loss: HeadLoss | None = None
    ) -> Pipeline:
        """Split ``model`` into this rank's pipeline stages, each parallelized like a whole model
        (``head_loss``: the last stage fuses the head into the loss, see :func:`build_pipeline`)."""
        device_type = self.device.type
        stage_layout = lambda stage: parallelize(stage, self.dims, config, device_type)  # noqa: E731
        return build_pipeline(model, self.dims, config, self.device, loss_fn, stage_layout, head_loss)

    @property
    def pp_mesh(self):
        """The pipeline-parallel mesh (None without pipeline parallelism)."""
        return self.dims.submesh("pp")

    @property
    def fsdp(self) -> bool:
        return uses_fsdp(self.dims)


def setup_parallel(config: JobConfig, device: torch.device) -> ParallelContext:
    """Join the process group, check the layout against the world size, build the mesh."""
    if config.parallel.cpu_offload and device.type != "cuda":
        raise ConfigError(
            "parallel.cpu_offload moves GPU parameters and optimizer state to host memory; a CPU run has nothing to "
            "offload, set it to false"
        )
    env = init_distributed(device.type)
    check_layout(config, env.world_size)
    dims = ParallelDims.from_config(config.parallel, env.world_size)
    if env.is_distributed:
        dims.build_mesh(device.type)
    return ParallelContext(env, dims, device_for(env, device.type) if env.is_distributed else device)


def scalar(value: torch.Tensor) -> float:
    """A Python float from a tensor or DTensor (gathering a sharded one)."""
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return value.item()


def local_value(value: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a tensor or a replicated DTensor (loss parallelism), without a host sync."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def teardown_parallel() -> None:
    """Leave the process group (end of a distributed run)."""
    if dist.is_initialized():
        dist.destroy_process_group()
