"""Attention sinks (gpt-oss): one learned logit per head in the denominator of every softmax.

Each query's weights are softmax([scores, sink_h]) with the sink's column dropped, so a head may
put weight on "no key at all" (the weights then sum to less than one) instead of on whatever key
is nearest (Xiao et al. 2023; OpenAI gpt-oss). Eager attention appends the column (as HF does).

Every sdpa-based kernel holds the sink as a *virtual key*: queries gain a channel holding
``sink_h / scale`` (so a query head's sink stays its own under GQA), real keys a channel of zeros,
and one key whose only nonzero channel is that one (value zero) is put first, seen by every query.
Its score is exactly ``sink_h``, its value adds nothing: the dense call, each block of the
block-sparse kernels and context parallelism's all-gathered keys keep their own fused kernel and
backward, and the sink enters each softmax once. The ring (context parallelism) starts each
query's running log-sum-exp at the sink instead (see :func:`ring_start`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from tessera import registry
from tessera.config.checks import require

# Channels the virtual key adds: one, padded to a multiple of 8 (fused GPU kernels take head sizes in 8s).
_SINK_CHANNELS = 8


class AttentionSinks(nn.Module):
    """The per-head sink logits (n_heads,); called, returns them (a tensor-parallel plan shards them by head)."""

    def __init__(self, n_heads: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_heads))

    def reset_parameters(self) -> None:
        """Zero logits: each sink starts as one more key of score 0."""
        nn.init.zeros_(self.weight)

    def forward(self) -> torch.Tensor:
        """The sink logits of this module's heads."""
        return self.weight


def with_sink_key(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, H, Tq, D) queries and (B, Hkv, Tk, D) keys/values with the virtual sink key first (Tk + 1 keys).

    Values gain zero channels too (slice the output back to D): with one head size for all three, CPU and
    GPU sdpa keep their fused kernels (1.7x a plain causal call on a loaded 2-core CPU instead of 2.8x)."""
    batch, heads, q_len, dim = q.shape
    sink = (sinks.to(q.dtype) / scale).view(1, heads, 1, 1).expand(batch, heads, q_len, 1)
    q = torch.cat([q, sink, q.new_zeros(batch, heads, q_len, _SINK_CHANNELS - 1)], dim=-1)
    key = k.new_zeros(k.shape[0], k.shape[1], 1, dim + _SINK_CHANNELS)
    key[..., dim] = 1.0
    k = torch.cat([key, F.pad(k, (0, _SINK_CHANNELS))], dim=2)
    return q, k, F.pad(v, (0, q.shape[-1] - v.shape[-1], 1, 0))


def mask_with_sink(mask: torch.Tensor) -> torch.Tensor:
    """A bool (True = allowed) or additive float mask (..., Tq, Tk) with the sink's column first, always allowed."""
    return F.pad(mask, (1, 0), value=True if mask.dtype == torch.bool else 0.0)


def sink_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
    dropout: float = 0.0,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with per-head sinks: ``mask`` (bool or additive) or plain causal
    over a square block (``is_causal``; with the sink first it is the lower-right causal pattern)."""
    gqa, dim = k.shape[1] != q.shape[1], v.shape[-1]
    q, k, v = with_sink_key(q, k, v, sinks, scale)
    if mask is not None:
        mask = mask_with_sink(mask)
    elif is_causal:
        if gqa:  # the lower-right causal bias takes no GQA: expand the key/value heads
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        mask = causal_lower_right(q.shape[2], k.shape[2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale)[..., :dim]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale, enable_gqa=gqa)
    return out[..., :dim]


def softmax_with_sink(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Weights of (B, H, Tq, Tk) masked scores with the sink column in the denominator (dropped after)."""
    column = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, column], dim=-1).softmax(dim=-1)[..., :-1]


def ring_start(sinks: torch.Tensor, lse_shape: torch.Size) -> torch.Tensor:
    """The running log-sum-exp (B, Hkv, rep, Tq) of a ring pass before its first block: the sink's logit
    (its value is zero, so the running output starts at zero); entered once, on the queries' own rank."""
    _, hkv, rep, _ = lse_shape
    return sinks.float().view(1, hkv, rep, 1).expand(lse_shape).clone()


def ring_sink_grad(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks of a ring pass: the sink's weight exp(sink - lse) times its value (zero) minus
    delta = dout . out, summed over batch and queries (the softmax backward of one more column)."""
    p = torch.exp(sinks.float().view(1, *lse.shape[1:3], 1) - lse)
    return -(p * delta).sum(dim=(0, 3)).reshape(sinks.shape).to(sinks.dtype)


def check_sinks(m: Any) -> None:
    """Sinks need a kernel that forms a softmax over scores, and standard attention (not latent)."""
    kernel = m.attention.kernel
    softmax = [name for name in registry.names("attention_kernel") if registry.get("attention_kernel", name).scores]
    require(
        kernel in softmax,
        f"model.attention.sinks needs a softmax kernel ({', '.join(softmax)}); model.attention.kernel='{kernel}' has "
        "no softmax denominator to hold a sink",
    )
    require(
        not m.mla.kv_rank,
        "model.attention.sinks is for standard attention; latent attention (model.mla.kv_rank > 0) has no sinks: "
        "set one of them off",
    )


SPEC = registry.option(
    name="attention_sinks",
    feature="attention sinks (gpt-oss)",
    keys=("model.attention.sinks",),
    uses=lambda m: m.attention.sinks,
    unsupported={},
    checks=(check_sinks,),
)
