"""``chunked``: exact softmax attention, a block of queries at a time, each block recomputed in backward
(Rabe & Staats 2021, "Self-attention does not need O(n^2) memory").

The fp32 scores of one block of :data:`QUERY_BLOCK` queries exist at a time, forward and backward,
so training keeps q, k, v and the output instead of a (T x T) probability matrix per head: the
eager kernel's numbers (fp32 softmax, any mask, score bias or dropout) at the memory of a fused
kernel, on any device, without a fused kernel for the case (a float bias on CPU sends sdpa to its
math path, which keeps the whole matrix). The cost is one more forward of the scores in backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tessera.model.kernels.common import AttentionLayer, AttnContext, attention_flops
from tessera.model.kernels.sdpa import block_sparse_attention
from tessera.registry import ATTENTION_TP, KernelSpec, Terms, register, uses_kernel

QUERY_BLOCK = 128  # query rows per block: the scores in flight are QUERY_BLOCK x keys per head


def _block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    allowed: torch.Tensor | None,
    scale: float,
    dropout: float,
) -> torch.Tensor:
    """softmax(q k^T * scale + bias, masked) v of one block of queries, in fp32; GQA by broadcasting each KV
    head over its group of query heads (no repeated copies of k and v)."""
    batch, heads, rows, dim = q.shape
    group = heads // k.shape[1]
    grouped = q.float().view(batch, k.shape[1], group, rows, dim)
    scores = (grouped @ k.float()[:, :, None].transpose(-2, -1)).view(batch, heads, rows, -1) * scale
    if bias is not None:
        scores = scores + bias
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    weights = F.dropout(scores.softmax(dim=-1), p=dropout, training=dropout > 0)
    out = weights.view(batch, k.shape[1], group, rows, -1) @ v.float()[:, :, None]
    return out.view(batch, heads, rows, dim)


def _rows(x: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor | None:
    """Query rows ``lo:hi`` of a (B|1, H|1, Tq, Tk) mask or bias (None stays None)."""
    return None if x is None else x[..., lo:hi, :]


def _causal_rows(lo: int, hi: int, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """The implicit causal mask of query rows ``lo:hi`` (the last query sees every key)."""
    rows = torch.arange(lo, hi, device=device)[:, None] + (kv_len - q_len)
    return rows >= torch.arange(kv_len, device=device)[None]


def chunked_attend(
    layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttnContext, dropout: float
) -> torch.Tensor:
    """The eager kernel's attention, a block of queries at a time, each block checkpointed under autograd."""
    if ctx.blocks is not None:  # a block-sparse plan runs block-sparse whichever softmax kernel is set
        return block_sparse_attention(q, k, v, ctx.blocks, layer.scale, dropout)
    q_len, kv_len = q.shape[2], k.shape[2]
    bias = ctx.bias
    outs = []
    for lo in range(0, q_len, QUERY_BLOCK):
        hi = min(lo + QUERY_BLOCK, q_len)
        allowed = _rows(ctx.mask, lo, hi)
        if allowed is None and ctx.is_causal:
            allowed = _causal_rows(lo, hi, q_len, kv_len, q.device)
        args = (q[:, :, lo:hi], k, v, _rows(bias, lo, hi), allowed, layer.scale, dropout)
        grads = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        outs.append(checkpoint(_block, *args, use_reentrant=False) if grads else _block(*args))
    return torch.cat(outs, dim=2).to(q.dtype)


def _memory(cfg: Any, heads: int, q_width: int, kept: float) -> tuple[float, float]:
    """What a fused kernel keeps but its logsumexp: q, k, v and the output; each block's scores and
    probabilities are recomputed in backward."""
    return kept - 4.0 * heads, 0.0


SPEC = register(
    KernelSpec(
        name="chunked",
        feature="chunked kernel (exact, query blocks recomputed in backward)",
        keys=("model.attention.kernel", "model.attention.dropout"),
        uses=uses_kernel("chunked"),
        unsupported={},
        checks=(),
        terms=Terms(flops=attention_flops, memory=_memory),
        tp_plan=ATTENTION_TP,
        attend=chunked_attend,
    )
)
