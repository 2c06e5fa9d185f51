"""The seam between the training loop and a non-torch engine: backward, optimizer step, checkpoint state.

The trainer computes losses the same way for every engine. Under ``parallel.engine = "torch"``
(FSDP2/DDP/TP/PP/CP/EP, GradScaler, global-norm clipping, AdamW) it steps itself; under
``"deepspeed"`` its step runner (``train/steps.py``, ``DeepSpeedSteps``) hands backward, step, save and load
to :class:`DeepSpeedEngine` (ZeRO-1/2/3 with offload). Both write tessera's own DCP checkpoint
layout, so a run started under one engine resumes under the other, at any world size.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tessera.config import JobConfig
from tessera.parallel import deepspeed as ds
from tessera.parallel import ds_ops
from tessera.train.checkpoint import (
    Checkpointer,
    load_rng_state,
    load_tensors,
    read_meta,
)
from tessera.train.distributed import ParallelContext
from tessera.train.optim import build_optimizer, build_scheduler, parameter_groups

_LOAD_CHUNK_BYTES = 1 << 30  # full tensors every rank holds at once while loading into DeepSpeed


class DeepSpeedEngine:
    """DeepSpeed ZeRO over tessera's model, AdamW groups (CPU Adam when offloaded) and LR schedule."""

    def __init__(self, config: JobConfig, model: nn.Module, parallel: ParallelContext) -> None:
        o, zero = config.optim, config.parallel.deepspeed
        ops = ds_ops.op_names(zero.offload_optimizer, zero.offload_params, parallel.device.type == "cpu")
        ds_ops.prepare_builds(ops, announce=parallel.env.local_rank == 0)  # before any build waits on a dead lock
        if config.parallel.deepspeed.offload_optimizer == "none":
            self.optimizer = build_optimizer(model, o, fused_ok=False)  # DeepSpeed's wrapper: torch's default kernel
        else:
            groups = parameter_groups(model, o.weight_decay)
            self.optimizer = ds.cpu_adam(groups, o.lr, (o.beta1, o.beta2), o.eps)
        self.scheduler = build_scheduler(self.optimizer, o, config.train.steps)
        self.module = model
        self.names = ds.parameter_names(model)
        self.keys = ds.state_keys(model)
        self.group_names = [[self.names[id(p)] for p in g["params"]] for g in self.optimizer.param_groups]
        ds.ensure_process_group(parallel.device.type)
        ds_config = ds.deepspeed_config(config, parallel.dp_size, parallel.device.type)
        ds.check_with_deepspeed(config, ds_config)
        self.model = ds.initialize(model, self.optimizer, self.scheduler, ds_config)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's loss; tessera already divided it by the accumulation steps."""
        self.model.backward(loss, scale_wrt_gas=False)
        if not self.model.is_gradient_accumulation_boundary():
            self.model.step()  # DeepSpeed counts micro-batches in step(); it steps the optimizer at the boundary

    def step(self) -> float:
        """Reduce, clip and step (optimizer and LR schedule, inside DeepSpeed); returns the grad norm."""
        self.model.step()
        norm = self.model.get_global_grad_norm()
        return float(norm) if norm is not None else math.nan

    def parameter_sums_of_squares(self) -> dict[str, float]:
        """Per-parameter sums of squares of the full fp32 weights (collective)."""
        from tessera.parallel.checksum import canonical_name

        return {
            canonical_name(name): ds.full_weight(p).double().pow(2).sum().item()
            for name, p in self.module.named_parameters()
        }

    def save(self, checkpointer: Checkpointer, step: int, extra: dict[str, Any]) -> Path:
        """Checkpoint full weights and Adam state in tessera's layout, each tensor written by one rank."""
        model, optim = {}, {}
        count = torch.tensor(float(ds.optimizer_step_count(self.model)))
        ds.link_optimizer_state(self.model)
        for i, (key, param, buffer) in enumerate(ds.state_entries(self.module, self.keys)):
            mine = i % self.world == self.rank
            if param is None:
                if mine:
                    model[key] = buffer.detach().cpu().clone()
                continue
            weight = ds.full_weight(param)  # collectives: every rank takes part for every tensor
            first = self.names[id(param)] == key  # a tied weight's state is stored under its first name
            moments = ds.full_moments(self.model, param) if first else {}
            if mine:
                model[key] = weight
                if first:
                    optim[key] = {"step": count.clone(), **moments}
        return checkpointer.save_state(step, model, optim, self._param_groups(), extra)

    def _param_groups(self) -> list[dict[str, Any]]:
        """The client optimizer's groups as torch's AdamW writes them (so the torch engine resumes them)."""
        template = torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).param_groups[0]
        groups = []
        for group, names in zip(self.optimizer.param_groups, self.group_names):
            keys = ("lr", "betas", "eps", "weight_decay", "initial_lr")
            groups.append({**template, **{k: group[k] for k in keys if k in group}, "params": list(names)})
        return groups

    def load(self, path: Path) -> dict[str, Any]:
        """Restore full weights and Adam state from a tessera checkpoint written by any engine and layout."""
        meta = read_meta(path)
        first = self.group_names[0][0] if self.group_names[0] else self.group_names[1][0]
        probe = {"optim": {first: {"step": torch.tensor(0.0)}}}
        load_tensors(path, probe)
        ds.create_optimizer_state(self.model, int(probe["optim"][first]["step"]))
        for chunk in self._chunks():
            self._load_chunk(path, chunk)
        ds.finish_loading(self.model)
        for group, saved in zip(self.optimizer.param_groups, meta["optim_param_groups"]):
            group.update({k: saved[k] for k in ("lr", "initial_lr") if k in saved})
        self.model.global_steps = int(meta["step"])
        self.model.global_samples = int(meta["step"]) * self.model.train_batch_size()
        load_rng_state(path)
        return meta

    def _chunks(self) -> list[list[tuple[str, nn.Parameter | None, torch.Tensor | None]]]:
        chunks, size = [[]], 0
        for entry in ds.state_entries(self.module, self.keys):
            numel = ds.full_shape(entry[1]).numel() if entry[1] is not None else entry[2].numel()
            if chunks[-1] and size + 12 * numel > _LOAD_CHUNK_BYTES:  # weight + two moments in fp32
                chunks.append([])
                size = 0
            chunks[-1].append(entry)
            size += 12 * numel
        return chunks

    def _load_chunk(self, path: Path, chunk: list[tuple[str, nn.Parameter | None, torch.Tensor | None]]) -> None:
        model, optim = {}, {}
        for key, param, buffer in chunk:
            model[key] = torch.empty(ds.full_shape(param)) if param is not None else buffer.detach().cpu().clone()
            if param is not None and self.names[id(param)] == key:
                optim[key] = {m: torch.empty(ds.full_shape(param)) for m in ds.ADAM_MOMENTS}
        tensors = {"model": model, "optim": optim}
        load_tensors(path, tensors)
        for key, param, buffer in chunk:
            if param is None:
                buffer.copy_(model[key])
            elif key in optim:
                ds.set_full(param, model[key], optim[key])
