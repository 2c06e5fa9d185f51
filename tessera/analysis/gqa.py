"""``tessera convert gqa``: multi-head (or grouped-query) attention -> fewer KV heads by mean pooling.

Ainslie et al. (2023), "GQA: Training Generalized Multi-Query Transformer Models from Multi-Head
Checkpoints": the key and value projection heads of each group are replaced by their mean, then
the model is up-trained for a small fraction (they use 5%) of its original pre-training steps.
Groups are contiguous, as the attention repeats KV heads (KV head j serves query heads
j*g .. j*g+g-1), so pooling ``r = old / new`` neighbouring KV heads keeps every query head with the
KV heads it was trained with, averaged. The KV cache shrinks by ``r``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from tessera.analysis.runs import (
    check_new_run_dir,
    count_kv_bytes,
    load_run,
    uptrain_config,
    validation_batches,
    validation_loss,
    write_run,
)
from tessera.config import ConfigError, ModelConfig
from tessera.validate import validate_model
from tessera.model import build_model, count_parameters
from tessera.model.attention import Attention


def gqa_config(cfg: ModelConfig, kv_heads: int) -> ModelConfig:
    """``cfg`` with ``kv_heads`` KV heads (per-layer head counts keep their query heads)."""
    old = cfg.n_kv_heads or cfg.n_heads
    if cfg.mla.kv_rank:
        raise ConfigError("--kv-heads: latent attention (model.mla) has no KV heads to pool")
    if not 1 <= kv_heads < old or old % kv_heads:
        raise ConfigError(f"--kv-heads {kv_heads} must divide the model's {old} KV heads and be fewer than them")
    new = copy.deepcopy(cfg)
    new.n_kv_heads = kv_heads
    try:
        validate_model(new)
    except ConfigError as err:
        raise ConfigError(f"--kv-heads {kv_heads} does not fit this model: {err}") from None
    return new


def pooled_state(model: nn.Module, ratio: int) -> dict[str, torch.Tensor]:
    """``model``'s state dict with every ``ratio`` neighbouring KV heads of each attention module averaged."""
    state = dict(model.state_dict())
    for name, attn in model.named_modules():
        if not isinstance(attn, Attention):
            continue
        parts = ["k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias"]
        if attn.k_norm is not None and attn.qk_norm_all:  # a norm over all KV heads' channels
            parts.append("k_norm.weight")
        for part in parts:
            key = f"{name}.{part}"
            if key in state:
                t = state[key]
                heads = t.view(-1, ratio, attn.head_dim, *t.shape[1:])
                state[key] = heads.mean(1).reshape(-1, *t.shape[1:]).clone()
    return state


def pool_kv_heads(model: nn.Module, kv_heads: int) -> nn.Module:
    """A new model with ``kv_heads`` KV heads, each the mean of its group's KV heads of ``model``."""
    cfg = gqa_config(model.cfg, kv_heads)
    pooled = build_model(cfg)
    pooled.load_state_dict(pooled_state(model, (model.cfg.n_kv_heads or model.cfg.n_heads) // kv_heads))
    return pooled.eval()


def convert_gqa(
    run: str,
    kv_heads: int,
    out: str,
    uptrain_fraction: float = 0.05,
    batches: int = 0,
    overrides: list[str] | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Pool the KV heads of the run at ``run`` into ``kv_heads`` and write the run ``out`` that up-trains it
    (``uptrain_fraction`` of the source's steps, then ``overrides``); returns the record (losses, KV-cache bytes
    per token)."""
    source = load_run(run)
    model = source.model
    pooled = pool_kv_heads(model, kv_heads)
    job = uptrain_config(source.config, pooled.cfg, check_new_run_dir(out), uptrain_fraction, overrides)
    val, loader_state = validation_batches(source.config, batches)
    kv_before, kv_after = count_kv_bytes(model), count_kv_bytes(pooled)
    record = {
        "operation": "convert gqa",
        "kv_heads": [model.cfg.n_kv_heads or model.cfg.n_heads, kv_heads],
        "before": {"val_loss": validation_loss(model, val), "parameters": count_parameters(model)},
        "after": {"val_loss": validation_loss(pooled, val), "parameters": count_parameters(pooled)},
        "kv_cache_bytes_per_token": [kv_before, kv_after],
        "uptrain_steps": job.train.steps,
    }
    ckpt = write_run(source, pooled, job, loader_state, record)
    b, a = record["before"], record["after"]
    log(
        f"KV heads {record['kv_heads'][0]} -> {kv_heads}: KV cache {kv_before:,} -> {kv_after:,} bytes per token "
        f"(fp32); parameters {b['parameters']:,} -> {a['parameters']:,}; val loss {b['val_loss']:.4f} -> "
        f"{a['val_loss']:.4f} right after pooling ({len(val)} validation batches)"
    )
    log(f"wrote {ckpt}; up-train with: tessera train {out}/config.toml ({job.train.steps} steps)")
    return record
