"""``tessera prune heads``: remove the least important attention heads and write a smaller model.

Heads go in whole KV groups: in a GQA model a group is one key/value head with the query heads
that share it, so every layer keeps the model's group size and ``n_kv_heads / n_heads`` ratio (in
a multi-head model a group is one head). Each layer keeps at least one group. The result has
per-layer head counts (``model.attention.heads_per_layer``) and sliced q, k, v and o projections;
when every layer keeps the same count it is a plain config (``n_heads``, ``n_kv_heads`` and an
explicit ``head_dim``), which HF families with a ``head_dim`` field can express.

Global pruning (the default) ranks all groups once (gradient scores normalized per layer by
their L2 norm, as Michel et al. 2019 do). ``layerwise`` prunes ``fraction`` of each layer's
groups one layer at a time, re-measuring importance on the partly pruned model before each layer
and printing the validation loss after it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from tessera.analysis.importance import (
    group_scores,
    head_importance,
    self_attention_layers,
)
from tessera.analysis.runs import (
    Batch,
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


def group_size(cfg: ModelConfig) -> int:
    """Query heads per KV head."""
    return cfg.n_heads // (cfg.n_kv_heads or cfg.n_heads)


def pruned_config(cfg: ModelConfig, counts: list[int]) -> ModelConfig:
    """``cfg`` with ``counts`` query heads per layer; a plain (uniform) config when all counts are equal."""
    new = copy.deepcopy(cfg)
    if len(set(counts)) == 1:
        new.head_dim = cfg.head_dim or cfg.dim // cfg.n_heads
        new.n_kv_heads = counts[0] // group_size(cfg) if cfg.n_kv_heads else 0
        new.n_heads = counts[0]
        new.attention.heads_per_layer = ""
    else:
        new.attention.heads_per_layer = ",".join(str(c) for c in counts)
    validate_model(new)
    return new


def _rows(heads: list[int], head_dim: int) -> torch.Tensor:
    """Row indices of ``heads`` in a (heads * head_dim, ...) projection."""
    return torch.cat([torch.arange(h * head_dim, (h + 1) * head_dim) for h in heads])


def sliced_state(model: nn.Module, keep: dict[int, list[int]]) -> dict[str, torch.Tensor]:
    """``model``'s state dict with only the KV groups ``keep[layer]`` (and their query heads) of those layers."""
    state = dict(model.state_dict())
    for i, groups in keep.items():
        attn = self_attention_layers(model)[i]
        g, d = attn.n_heads // attn.n_kv_heads, attn.head_dim
        heads = [j * g + r for j in groups for r in range(g)]
        q_rows, kv_rows = _rows(heads, d), _rows(groups, d)
        sinks = f"layers.{i}.attention.sinks.weight"  # per query head (gpt-oss)
        if sinks in state:
            state[sinks] = state[sinks][heads].clone()
        parts = [("q_proj", q_rows, 0), ("k_proj", kv_rows, 0), ("v_proj", kv_rows, 0), ("o_proj", q_rows, 1)]
        for part, rows, dim in parts:
            for kind in ("weight", "bias"):
                key = f"layers.{i}.attention.{part}.{kind}"
                if key in state and not (part == "o_proj" and kind == "bias"):
                    state[key] = state[key].index_select(dim, rows).clone()
    return state


def prune_model(model: nn.Module, keep: dict[int, list[int]]) -> nn.Module:
    """A new model with only the KV groups ``keep[layer]`` of the listed layers (the other layers whole)."""
    layers = self_attention_layers(model)
    g = group_size(model.cfg)
    counts = [len(keep[i]) * g if i in keep else layers[i].n_heads for i in sorted(layers)]
    cfg = pruned_config(model.cfg, counts)
    pruned = build_model(cfg)
    pruned.load_state_dict(sliced_state(model, keep))
    return pruned.eval()


def _lowest(scores: torch.Tensor, n: int) -> list[int]:
    return sorted(torch.argsort(scores, stable=True)[:n].tolist())


def plan_global(scores: dict[int, torch.Tensor], fraction: float, normalize: bool) -> dict[int, list[int]]:
    """Groups to remove per layer: the ``fraction`` of all groups with the lowest scores, one group left per layer."""
    if normalize:  # Michel et al.: gradient importance divided by its L2 norm within each layer
        scores = {i: s / s.norm().clamp_min(1e-12) for i, s in scores.items()}
    ranked = sorted((s.item(), i, j) for i, layer in scores.items() for j, s in enumerate(layer))
    target = int(fraction * len(ranked) + 0.5)
    removed: dict[int, list[int]] = {i: [] for i in scores}
    for _, i, j in ranked:
        if sum(map(len, removed.values())) == target:
            break
        if len(scores[i]) - len(removed[i]) > 1:
            removed[i].append(j)
    return {i: sorted(r) for i, r in removed.items()}


def _kept(n_groups: int, removed: list[int]) -> list[int]:
    return [j for j in range(n_groups) if j not in removed]


def _heads(groups: list[int], g: int) -> list[int]:
    return [j * g + r for j in groups for r in range(g)]


def _scores(model: nn.Module, batches: list[Batch], metric: str) -> dict[int, torch.Tensor]:
    g = group_size(model.cfg)
    return {i: group_scores(s, g, metric) for i, s in head_importance(model, batches, metric).items()}


def prune_global(
    model: nn.Module, batches: list[Batch], metric: str, fraction: float, log: Callable[[str], None]
) -> tuple[nn.Module, dict[int, list[int]]]:
    """Rank every KV group of the model once and remove the lowest ``fraction``; returns (model, removed heads)."""
    scores = _scores(model, batches, metric)
    removed = plan_global(scores, fraction, normalize=metric == "gradient")
    g = group_size(model.cfg)
    pruned = prune_model(model, {i: _kept(len(s), removed[i]) for i, s in scores.items()})
    heads = {i: _heads(r, g) for i, r in removed.items()}
    log(f"global ({metric}): removed heads {_describe(heads)}; val loss {validation_loss(pruned, batches):.4f}")
    return pruned, heads


def prune_layerwise(
    model: nn.Module, batches: list[Batch], metric: str, fraction: float, log: Callable[[str], None]
) -> tuple[nn.Module, dict[int, list[int]]]:
    """Per layer in order: measure importance on the current model, remove ``fraction`` of that layer's groups
    (at least one group stays), print the validation loss."""
    g = group_size(model.cfg)
    heads: dict[int, list[int]] = {}
    for i in sorted(self_attention_layers(model)):
        scores = _scores(model, batches, metric)[i]
        n = min(int(fraction * len(scores) + 0.5), len(scores) - 1)
        removed = _lowest(scores, n)
        heads[i] = _heads(removed, g)
        if removed:
            model = prune_model(model, {i: _kept(len(scores), removed)})
        log(f"layer {i} ({metric}): removed heads {heads[i] or 'none'}; val loss {validation_loss(model, batches):.4f}")
    return model, heads


def _describe(heads: dict[int, list[int]]) -> str:
    return "; ".join(f"layer {i}: {h or 'none'}" for i, h in sorted(heads.items()))


def check_prunable(cfg: ModelConfig) -> None:
    """Refuse, in one line, models whose attention cannot take per-layer head counts (the config's own check)."""
    probe = copy.deepcopy(cfg)
    probe.attention.heads_per_layer = ",".join([str(cfg.n_heads)] * cfg.n_layers)
    try:
        validate_model(probe)
    except ConfigError as err:
        raise ConfigError(f"tessera prune heads cannot prune this model: {err}") from None
    if cfg.attention.qk_norm and cfg.attention.qk_norm_scope == "all":
        raise ConfigError(
            "tessera prune heads cannot prune this model: model.attention.qk_norm_scope='all' normalizes all heads' "
            "queries and keys together, so removing heads would change the others (per-head qk_norm is fine)"
        )


def prune_heads(
    run: str,
    out: str,
    metric: str = "gradient",
    fraction: float = 0.25,
    layerwise: bool = False,
    uptrain_fraction: float = 0.05,
    batches: int = 0,
    overrides: list[str] | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Prune ``fraction`` of the heads of the run at ``run`` by ``metric`` and write the smaller model as the run
    ``out`` (with an up-training schedule of ``uptrain_fraction`` of the source's steps, then ``overrides``);
    returns the record."""
    if not 0 < fraction < 1:
        raise ConfigError(f"--fraction must be in (0, 1), got {fraction}")
    source = load_run(run)
    check_prunable(source.config.model)
    uptrain_config(source.config, source.config.model, check_new_run_dir(out), uptrain_fraction, overrides)
    val, loader_state = validation_batches(source.config, batches)
    model = source.model
    before = {"val_loss": validation_loss(model, val), "parameters": count_parameters(model)}
    log(f"{run}: {before['parameters']:,} parameters, val loss {before['val_loss']:.4f} on {len(val)} batches")
    pruner = prune_layerwise if layerwise else prune_global
    pruned, heads = pruner(model, val, metric, fraction, log)
    after = {"val_loss": validation_loss(pruned, val), "parameters": count_parameters(pruned)}
    job = uptrain_config(source.config, pruned.cfg, Path(out), uptrain_fraction, overrides)
    record = {
        "operation": "prune heads",
        "metric": metric,
        "fraction": fraction,
        "layerwise": layerwise,
        "removed_heads": {str(i): h for i, h in heads.items()},
        "heads_per_layer": [a.n_heads for _, a in sorted(self_attention_layers(pruned).items())],
        "before": before,
        "after": after,
        "kv_cache_bytes_per_token": [count_kv_bytes(model), count_kv_bytes(pruned)],
    }
    ckpt = write_run(source, pruned, job, loader_state, record)
    log(
        f"parameters {before['parameters']:,} -> {after['parameters']:,}; heads per layer "
        f"{record['heads_per_layer']}; val loss {before['val_loss']:.4f} -> {after['val_loss']:.4f}"
    )
    log(f"wrote {ckpt}; up-train with: tessera train {out}/config.toml ({job.train.steps} steps)")
    return record
