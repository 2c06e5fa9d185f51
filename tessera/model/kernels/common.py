"""What the attention kernels share: the context's boolean mask, KV heads repeated for GQA, and the
planner terms of the softmax kernels."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from tessera.registry import Terms

if TYPE_CHECKING:
    from tessera.model.attention import AttnContext


def allowed_mask(ctx: AttnContext, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor | None:
    """The context's boolean mask, materializing the implicit causal one when needed."""
    if ctx.mask is None and ctx.is_causal:
        return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - q_len)
    return ctx.mask


def repeat_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values with as many heads as the queries (GQA groups repeated)."""
    rep = q.shape[1] // k.shape[1]
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


def attention_flops(cfg: Any, seq_len: int) -> float:
    """Training FLOPs per token of one layer's score and value products over all ``seq_len`` keys (PaLM
    appendix B: 12 * H * Q * T, forward and backward; the planner's ModelShape.block_flops counts the same)."""
    return 12.0 * cfg.n_heads * (cfg.head_dim or cfg.dim // cfg.n_heads) * seq_len


def eager_memory(heads: int, q_width: int, kept: float) -> tuple[float, float]:
    """Saved bytes of a materialized softmax: fp32 scores and probabilities per key, fp32 copies of q and
    the repeated k, v; no logsumexp. Returns (kept bytes per token, score bytes per token per key)."""
    return kept + 12.0 * q_width - 4.0 * heads, 8.0 * heads


def flash_memory(cfg: Any, heads: int, q_width: int, kept: float) -> tuple[float, float]:
    """A fused kernel keeps its output and logsumexp only; with attention dropout sdpa runs the math path."""
    return eager_memory(heads, q_width, kept) if cfg.attention.dropout > 0 else (kept, 0.0)


SOFTMAX_TERMS = Terms(flops=attention_flops, memory=flash_memory)
