"""What the model-changing tools share: read a source run, measure on its validation split, write a new run.

A derived run (pruned heads, pooled KV heads) is an ordinary run directory: ``config.toml`` (the
source's recipe with the new model and a short up-training schedule), the tokenizer, and a step-0
checkpoint with fresh optimizer and schedule and the source's data position, so ``tessera train
NEW_RUN/config.toml`` up-trains on data the source has not seen yet. ``derived_from`` in the
checkpoint and a JSON report in the run directory say where it came from.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tessera.config import ConfigError, JobConfig, ModelConfig, parse_overrides
from tessera.data.objectives import Objective
from tessera.train.checkpoint import Checkpointer, CheckpointError, read_meta
from tessera.train.rundir import carry_run_files
from tessera.validate import apply_overrides, config_from_dict

Batch = tuple[tuple[torch.Tensor, ...], dict[str, Any], torch.Tensor, torch.Tensor | None]


@dataclass
class SourceRun:
    """A trained run: its resolved config, newest checkpoint (and its JSON part), model and run directory."""

    config: JobConfig
    checkpoint: Path
    meta: dict[str, Any]
    model: nn.Module
    run_dir: Path


def load_run(path: str | Path) -> SourceRun:
    """The run (or checkpoint) at ``path`` with its model in eval mode on CPU."""
    from tessera.api import find_checkpoint
    from tessera.hf.weights import is_hf_dir

    if is_hf_dir(path):
        raise CheckpointError(f"'{path}' is an HF directory; import it first: tessera convert hf-import {path} RUN_DIR")
    ckpt = find_checkpoint(path)
    meta = read_meta(ckpt)
    config = config_from_dict(meta["config"], where=str(ckpt / "meta.json"))
    from tessera.model import build_model

    model = build_model(config.model)
    Checkpointer(ckpt.parent.parent, keep_last=1).load(ckpt, model, restore_rng=False)
    return SourceRun(config, ckpt, meta, model.eval(), ckpt.parent.parent)


def validation_batches(config: JobConfig, n_batches: int = 0) -> tuple[list[Batch], dict[str, Any]]:
    """The first ``n_batches`` (default ``train.eval_batches``) global batches of the validation split, as
    ``(args, kwargs, labels, loss_mask)`` (the objective's masks seeded as in training), and a fresh loader
    state for runs that have none."""
    from tessera.data.pipeline import build_data

    data = build_data(config)
    try:
        val, bs = data.val, config.train.batch_size
        if val is None or len(val) == 0:
            raise ConfigError(
                "the run's data has no validation split; set data.val_fraction > 0 (or data.split) in its config"
            )
        n = min(len(val), (n_batches or config.train.eval_batches) * bs) // bs * bs
        starts, size = (range(0, n, bs), bs) if n else ([0], len(val))
        objective = Objective(config.model, config.train.seed)
        batches = [objective(data.collate([val[i] for i in range(s, s + size)])) for s in starts]
        return batches, data.train.state_dict()
    finally:
        data.train.close()


@torch.no_grad()
def validation_loss(model: nn.Module, batches: list[Batch]) -> float:
    """Token-weighted mean cross-entropy over ``batches`` (as the trainer's evaluation)."""
    from tessera.train.trainer import lm_loss

    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for args, kwargs, labels, loss_mask in batches:
        weight = labels.numel() if loss_mask is None else int(loss_mask.sum())
        total += lm_loss(model(*args, **kwargs), labels, loss_mask=loss_mask).item() * weight
        count += weight
    model.train(was_training)
    return total / max(count, 1)


def uptrain_config(
    source: JobConfig, model: ModelConfig, out: Path, fraction: float, overrides: list[str] | None = None
) -> JobConfig:
    """The source recipe with ``model``, ``out`` as run directory and ``fraction`` of its steps (at least 1),
    warming up over a tenth of them (the up-training of Ainslie et al. 2023, who use 5%), then ``overrides``
    (dotted keys, not of [model]: the weights fix it)."""
    if not 0 < fraction <= 1:
        raise ConfigError(f"--uptrain-fraction must be in (0, 1], got {fraction}")
    touched = [key for key, _ in parse_overrides(overrides or []) if key.startswith("model.")]
    if touched:
        raise ConfigError(f"override '{touched[0]}' would change the model the weights were made for; drop it")
    job = copy.deepcopy(source)
    job.model = copy.deepcopy(model)
    job.train.run_dir = str(out)
    job.train.resume = "auto"
    job.train.steps = max(1, math.ceil(fraction * source.train.steps))
    job.optim.warmup_steps = min(job.optim.warmup_steps, max(1, job.train.steps // 10))
    job.checkpoint.every = min(job.checkpoint.every, job.train.steps)
    return apply_overrides(job, overrides or [])


def check_new_run_dir(out: str | Path) -> Path:
    """``out`` as a path, refusing a directory that already holds a run (nothing is overwritten)."""
    out = Path(out)
    if (out / "config.toml").exists() or (out / "checkpoints").exists():
        raise ConfigError(f"--out '{out}' already holds a run; choose a new directory (or delete that one)")
    return out


def write_run(
    source: SourceRun, model: nn.Module, job: JobConfig, loader_state: dict[str, Any], record: dict[str, Any]
) -> Path:
    """Write ``model`` as a new run (``job.train.run_dir``) that ``tessera train`` continues; returns the
    checkpoint. ``record`` (what was done, with numbers) goes into the checkpoint and ``derived.json``."""
    from tessera.train.optim import build_optimizer, build_scheduler

    out = check_new_run_dir(job.train.run_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.toml").write_text(job.to_toml(), encoding="utf-8")
    carry_run_files(source.run_dir, out)
    optimizer = build_optimizer(model, job.optim)
    scheduler = build_scheduler(optimizer, job.optim, job.train.steps)
    record = {**record, "source": str(source.checkpoint)}
    extra = {
        "scheduler": scheduler.state_dict(),
        "loader": source.meta.get("loader", loader_state),
        "model": job.to_dict()["model"],
        "config": job.to_dict(),
        "derived_from": record,
    }
    (out / "derived.json").write_text(json.dumps(record, indent=1) + "\n")
    return Checkpointer(out, keep_last=job.checkpoint.keep_last).save(0, model, optimizer, extra)


def count_kv_bytes(model: nn.Module) -> int:
    """Decoding-cache bytes per token of context (fp32) of a decoder or encoder-decoder; 0 for an encoder."""
    from tessera.model.generate import cache_footprint

    return cache_footprint(model)[0] if model.cfg.arch != "encoder" else 0
