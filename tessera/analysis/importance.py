"""How much each attention head matters, measured on validation batches.

- ``entropy``: the mean entropy of a head's attention rows. A head that spreads its weight evenly
  averages its inputs; a focused (low-entropy) head selects. Higher entropy = less important.
- ``gradient``: Michel et al. (2019), "Are Sixteen Heads Really Better than One?": a mask
  variable xi_h multiplies head h's output before the output projection, and the importance is
  E_x |dL(x)/dxi_h| at xi = 1 (per sequence, averaged over the validation sequences). A head whose
  output projection is zero has importance 0.

Both return one score per query head of each self-attention layer with "higher = more important"
(entropy is negated), keyed by layer index.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tessera.analysis.capture import is_cross, layer_index, observe_attention
from tessera.analysis.runs import Batch
from tessera.analysis.stats import row_entropy
from tessera.model.attention import Attention

METRICS = ("entropy", "gradient")


def self_attention_layers(model: nn.Module) -> dict[int, Attention]:
    """The standard self-attention module of each block, by block index (what pruning can slice)."""
    return {
        layer_index(name): m
        for name, m in model.named_modules()
        if isinstance(m, Attention) and not is_cross(name) and layer_index(name) >= 0
    }


@torch.no_grad()
def entropy_importance(model: nn.Module, batches: list[Batch]) -> dict[int, torch.Tensor]:
    """Minus the mean attention entropy (nats) of each head over the batches' query rows and sequences."""
    layers = self_attention_layers(model)
    names = {name for name, m in model.named_modules() if any(m is a for a in layers.values())}
    sums = {i: torch.zeros(a.n_heads) for i, a in layers.items()}
    rows = [0]

    def observe(name: str, weights: torch.Tensor) -> None:
        sums[layer_index(name)] += row_entropy(weights).mean(-1).sum(0).cpu()

    model.eval()
    with observe_attention(model, observe, names):
        for args, kwargs, _, _ in batches:
            model(*args, **kwargs)
            rows[0] += args[0].shape[0]
    return {i: -s / max(rows[0], 1) for i, s in sums.items()}


def _head_mask_hook(mask: torch.Tensor) -> Callable:
    """A forward pre-hook on ``o_proj`` multiplying each head's output (B, T, H * d) by ``mask`` (B, H)."""

    def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x = args[0]
        b, t, width = x.shape
        heads = x.view(b, t, mask.shape[1], width // mask.shape[1]) * mask[:, None, :, None].to(x.dtype)
        return (heads.view(b, t, width), *args[1:])

    return hook


def gradient_importance(model: nn.Module, batches: list[Batch]) -> dict[int, torch.Tensor]:
    """E_x |dL(x)/dxi_h| per head (Michel et al. 2019), with the per-sequence mean loss L(x)."""
    from tessera.train.trainer import lm_loss

    layers = self_attention_layers(model)
    sums = {i: torch.zeros(a.n_heads) for i, a in layers.items()}
    count = 0
    model.eval()
    for args, kwargs, labels, loss_mask in batches:
        b = labels.shape[0]
        masks = {i: torch.ones(b, a.n_heads, requires_grad=True) for i, a in layers.items()}
        handles = [a.o_proj.register_forward_pre_hook(_head_mask_hook(masks[i])) for i, a in layers.items()]
        try:
            loss = lm_loss(model(*args, **kwargs), labels, loss_mask=loss_mask)
        finally:
            for handle in handles:
                handle.remove()
        grads = torch.autograd.grad(loss * b, list(masks.values()))  # d(sum of per-sequence means)/dxi
        for i, grad in zip(masks, grads):
            sums[i] += grad.abs().sum(0)
        count += b
    return {i: s / max(count, 1) for i, s in sums.items()}


def head_importance(model: nn.Module, batches: list[Batch], metric: str) -> dict[int, torch.Tensor]:
    """Per-head importance of each self-attention layer by ``metric`` (entropy or gradient)."""
    if metric not in METRICS:
        raise ValueError(f"unknown importance metric {metric!r}; choose one of {', '.join(METRICS)}")
    return entropy_importance(model, batches) if metric == "entropy" else gradient_importance(model, batches)


def group_scores(scores: torch.Tensor, group: int, metric: str) -> torch.Tensor:
    """Per-KV-group importance from per-query-head scores: gradient importance adds up, entropy averages."""
    grouped = scores.view(-1, group)
    return grouped.sum(-1) if metric == "gradient" else grouped.mean(-1)
