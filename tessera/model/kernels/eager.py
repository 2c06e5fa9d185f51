"""``eager``: softmax(QK^T * scale + bias)V written out in float32; hands the weights to the layer's
``weights_observer`` when an inspection tool has set one (tools switch layers to this kernel)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from tessera.model.kernels.common import (
    AttentionLayer,
    AttnContext,
    allowed_mask,
    attention_flops,
    eager_memory,
    repeat_kv,
)
from tessera.model.kernels.sdpa import block_sparse_attention
from tessera.model.sinks import softmax_with_sink
from tessera.model.softcap import softcap
from tessera.registry import ATTENTION_TP, KernelSpec, Terms, register, uses_kernel


def eager_attend(
    layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttnContext, dropout: float
) -> torch.Tensor:
    """Dense fp32 scores, the context's bias and mask, softmax, dropout, then the values."""
    sinks = layer.sinks() if getattr(layer, "sinks", None) is not None else None
    if ctx.blocks is not None:  # a block-sparse plan runs block-sparse whichever softmax kernel is set
        if getattr(layer, "softcap", 0.0):
            raise ValueError("attention soft-capping runs on dense scores, not a block-sparse plan")
        return block_sparse_attention(q, k, v, ctx.blocks, layer.scale, dropout, sinks)
    k, v = repeat_kv(q, k, v)
    scores = (q.float() @ k.float().transpose(-2, -1)) * layer.scale
    cap = getattr(layer, "softcap", 0.0)
    if cap:  # Gemma 2: cap * tanh(scores / cap), before the mask
        scores = softcap(scores, cap)
    if ctx.bias is not None:
        scores = scores + ctx.bias
    mask = allowed_mask(ctx, q.shape[2], k.shape[2], q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = scores.softmax(dim=-1) if sinks is None else softmax_with_sink(scores, sinks)
    if layer.weights_observer is not None:
        layer.weights_observer(weights.detach())
    weights = F.dropout(weights, p=dropout, training=dropout > 0)
    return (weights @ v.float()).to(q.dtype)


def _eager_memory(cfg: Any, heads: int, q_width: int, kept: float) -> tuple[float, float]:
    return eager_memory(heads, q_width, kept)


SPEC = register(
    KernelSpec(
        name="eager",
        feature="eager kernel (fp32 softmax, inspectable weights)",
        keys=("model.attention.kernel", "model.attention.dropout"),
        uses=uses_kernel("eager"),
        unsupported={},
        checks=(),
        terms=Terms(flops=attention_flops, memory=_eager_memory),
        tp_plan=ATTENTION_TP,
        attend=eager_attend,
        dense_mask=True,
    )
)
