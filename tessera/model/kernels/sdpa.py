"""``sdpa``: ``F.scaled_dot_product_attention`` (flash/memory-efficient on GPU), block-sparse over a
windowed pattern's key blocks (masks.block_layout), a score bias folded into the mask."""

from __future__ import annotations


import torch
import torch.nn.functional as F

from tessera.model.kernels.common import AttentionLayer, AttnContext, SOFTMAX_TERMS, allowed_mask
from tessera.model.masks import BlockLayout
from tessera.model.sinks import mask_with_sink, sink_sdpa, with_sink_key
from tessera.registry import ATTENTION_TP, KernelSpec, register, uses_kernel


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: BlockLayout,
    scale: float,
    dropout: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(QK^T)V of (B, H, T, D) queries restricted to ``layout``'s blocks (see masks.block_layout).

    Each query block and its gathered key blocks (plus the global keys) form one item of a batched
    sdpa call; the global query rows are one more dense call over all keys. Keys and values may
    have fewer heads than queries (GQA). ``sinks`` (H,) puts each head's sink logit into every
    softmax (the virtual key of tessera.model.sinks, once per query block).
    """
    b, n, t = layout.block, layout.n_blocks, q.shape[2]
    batch, heads, _, dim = q.shape
    pad = n * b - t
    qb = F.pad(q, (0, 0, 0, pad)).view(batch, heads, n, b, dim).transpose(1, 2).reshape(batch * n, heads, b, dim)
    kb, vb = _key_blocks(k, layout, pad), _key_blocks(v, layout, pad)
    mask = layout.mask.expand(batch, *layout.mask.shape[1:]).reshape(batch * n, 1, b, -1)
    gqa = kb.shape[1] != heads
    if sinks is not None:
        (qb, kb, vb), mask = with_sink_key(qb, kb, vb, sinks, scale), mask_with_sink(mask)
    out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, dropout_p=dropout, scale=scale, enable_gqa=gqa)
    out = out[..., :dim].contiguous()  # a sink's padded value channels dropped (a no-op without sinks)
    out = out.view(batch, n, heads, b, dim).transpose(1, 2).reshape(batch, heads, n * b, dim)[:, :, :t]
    g = layout.n_global
    if not g:
        return out
    if sinks is not None:
        rows = sink_sdpa(q[:, :, :g], k, v, sinks, scale, layout.global_mask, dropout=dropout)
    else:
        rows = F.scaled_dot_product_attention(
            q[:, :, :g], k, v, attn_mask=layout.global_mask, dropout_p=dropout, scale=scale, enable_gqa=gqa
        )
    return torch.cat([rows, out[:, :, g:]], dim=2)


def _key_blocks(x: torch.Tensor, layout: BlockLayout, pad: int) -> torch.Tensor:
    """(B, H, T, D) keys or values -> (B * n_blocks, H, slots * block + n_global, D) per query block."""
    batch, heads, _, dim = x.shape
    n, b = layout.n_blocks, layout.block
    blocks = F.pad(x, (0, 0, 0, pad)).view(batch, heads, n, b, dim)[:, :, layout.key_blocks].flatten(3, 4)
    if layout.n_global:
        glob = x[:, :, None, : layout.n_global].expand(batch, heads, n, layout.n_global, dim)
        blocks = torch.cat([blocks, glob], dim=3)
    return blocks.transpose(1, 2).reshape(batch * n, heads, -1, dim)


def sdpa_attend(
    layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttnContext, dropout: float
) -> torch.Tensor:
    """torch's fused attention under the context's mask, block plan or score bias (and the layer's sinks)."""
    sinks = layer.sinks() if getattr(layer, "sinks", None) is not None else None
    if ctx.blocks is not None:
        return block_sparse_attention(q, k, v, ctx.blocks, layer.scale, dropout, sinks)
    gqa = k.shape[1] != q.shape[1]
    if sinks is not None and ctx.bias is None:
        return sink_sdpa(q, k, v, sinks, layer.scale, ctx.mask, ctx.is_causal, dropout)
    if ctx.bias is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=ctx.mask, dropout_p=dropout, is_causal=ctx.is_causal, scale=layer.scale, enable_gqa=gqa
        )
    allowed = allowed_mask(ctx, q.shape[2], k.shape[2], q.device)
    bias = ctx.bias.to(q.dtype)
    mask = bias if allowed is None else bias.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        return sink_sdpa(q, k, v, sinks, layer.scale, mask, dropout=dropout)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=layer.scale, enable_gqa=gqa)


SPEC = register(
    KernelSpec(
        name="sdpa",
        feature="sdpa kernel (flash on GPU; block-sparse with a sliding window)",
        keys=("model.attention.kernel", "model.attention.sliding_window", "model.attention.dropout"),
        uses=uses_kernel("sdpa"),
        unsupported={},
        checks=(),
        terms=SOFTMAX_TERMS,
        tp_plan=ATTENTION_TP,
        attend=sdpa_attend,
    )
)
