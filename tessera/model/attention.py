"""Multi-head attention: MHA/MQA/GQA, self or cross, KV cache, and the kernels of ``model.attention``.

``sdpa`` calls ``F.scaled_dot_product_attention`` (flash/memory-efficient on GPU); ``eager`` writes
softmax(QK^T * scale + bias)V out in float32 and hands the weights to ``weights_observer`` when an
inspection tool has set one (the linear kernels hand it their implicit weights); ``linear`` (elu + 1)
and ``performer`` (FAVOR+ random features) replace the softmax by a kernel feature map.

Windowed patterns (``sdpa`` with a sliding window, ``longformer``, ``bigbird``; see masks.py) run
block-sparse over whole sequences (:func:`block_sparse_attention`): each query block attends only
the key blocks its pattern reaches, gathered into one batched sdpa call, so memory and work grow as
O(length x window). Decoding with a sliding window keeps only the window in a ring buffer
(:class:`SlidingKVCache`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tessera.config import ModelConfig
from tessera.model.masks import BlockLayout, MaskSpec
from tessera.model.norm import RMSNorm, ZeroCenteredRMSNorm
from tessera.model.position import apply_rope

if TYPE_CHECKING:
    from tessera.model.moe import MoELog

LINEAR_KERNELS = ("linear", "performer")


class KVCache:
    """Preallocated keys and values of one attention layer for incremental decoding."""

    def __init__(
        self, batch: int, n_kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def key_start(self, start: int) -> int:
        """Position of the first key :meth:`update` returns for queries from ``start``: all are kept."""
        return 0

    def update(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write positions ``start..start+T-1`` and return all keys/values up to there."""
        end = start + k.shape[2]
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        # A cache kept in a narrower dtype (--kv-cache bf16 for an fp32 model) is read back in the model's.
        return self.k[:, :, :end].to(k.dtype), self.v[:, :, :end].to(v.dtype)


class SlidingKVCache:
    """Keys and values of the last ``window`` positions only, in a ring buffer (slot = position % window).

    A query at position p sees keys p - window + 1 .. p, so older ones are never read again: memory
    stays O(window) however long the generation.
    """

    def __init__(
        self, batch: int, n_kv_heads: int, head_dim: int, window: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        shape = (batch, n_kv_heads, window, head_dim)
        self.window = window
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def key_start(self, start: int) -> int:
        """Position of the first key :meth:`update` returns for queries from ``start``."""
        return max(0, start - self.window)

    def update(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of positions ``key_start(start) .. start+T-1`` (the kept ones, then the new
        ``T``); then keep the last ``window`` of them."""
        kept = torch.arange(self.key_start(start), start, device=k.device) % self.window
        keys, values = torch.cat([self.k[:, :, kept], k], dim=2), torch.cat([self.v[:, :, kept], v], dim=2)
        new = min(k.shape[2], self.window)
        slots = torch.arange(start + k.shape[2] - new, start + k.shape[2], device=k.device) % self.window
        self.k[:, :, slots] = k[:, :, -new:]
        self.v[:, :, slots] = v[:, :, -new:]
        return keys, values


def block_sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout, scale: float, dropout: float = 0.0
) -> torch.Tensor:
    """softmax(QK^T)V of (B, H, T, D) queries restricted to ``layout``'s blocks (see masks.block_layout).

    Each query block and its gathered key blocks (plus the global keys) form one item of a batched
    sdpa call; the global query rows are one more dense call over all keys. Keys and values may
    have fewer heads than queries (GQA).
    """
    b, n, t = layout.block, layout.n_blocks, q.shape[2]
    batch, heads, _, dim = q.shape
    pad = n * b - t
    qb = F.pad(q, (0, 0, 0, pad)).view(batch, heads, n, b, dim).transpose(1, 2).reshape(batch * n, heads, b, dim)
    kb, vb = _key_blocks(k, layout, pad), _key_blocks(v, layout, pad)
    mask = layout.mask.expand(batch, *layout.mask.shape[1:]).reshape(batch * n, 1, b, -1)
    gqa = kb.shape[1] != heads
    out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, dropout_p=dropout, scale=scale, enable_gqa=gqa)
    out = out.view(batch, n, heads, b, dim).transpose(1, 2).reshape(batch, heads, n * b, dim)[:, :, :t]
    g = layout.n_global
    if not g:
        return out
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


@dataclass
class AttnContext:
    """What all layers of one forward share: the mask, a score bias and the RoPE tables."""

    mask: torch.Tensor | None = None  # bool (B|1, 1, Tq, Tk), True where attention is allowed
    blocks: BlockLayout | None = None  # a windowed pattern's block-sparse plan (instead of ``mask``)
    bias: torch.Tensor | None = None  # float (B|1, H, Tq, Tk) added to the scores (T5 bias, ALiBi)
    is_causal: bool = False  # plain causal over a square block: sdpa's fast path, no mask tensor
    causal: bool = False  # the linear kernels' only mask
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    document_ids: torch.Tensor | None = None  # (B, T): recurrent mixers restart at each new document
    moe_log: MoELog | None = None  # where MoE layers record their routing (see tessera.model.moe.MoELog)
    # Replaces every layer's attention core, (layer, q, k, v, this context) -> output: set when this forward
    # holds only part of each sequence and its queries must reach the other parts' keys (see SequenceSplit);
    # ``bias`` then spans the local queries and the keys of SequenceSplit.key_positions.
    attend: Callable[[Attention, torch.Tensor, torch.Tensor, torch.Tensor, AttnContext], torch.Tensor] | None = None


class SequenceSplit(Protocol):
    """A forward that holds only some tokens of each sequence (context parallelism sets one on a
    :class:`~tessera.model.transformer.Stack` from outside; the zoo only calls it)."""

    def positions(self, length: int, device: torch.device) -> torch.Tensor:
        """(1, length) positions, in the whole sequence, of this forward's ``length`` tokens."""
        ...

    def key_positions(self, length: int, device: torch.device) -> torch.Tensor:
        """(1, keys) positions, in the whole sequence, of the keys the attention core scores, in its order
        (what a score bias such as ALiBi or T5's spans)."""
        ...

    def attention(
        self, spec: MaskSpec, length: int, document_ids: torch.Tensor | None, device: torch.device
    ) -> Callable[[Attention, torch.Tensor, torch.Tensor, torch.Tensor, AttnContext], torch.Tensor]:
        """The attention core of one forward's layers (:attr:`AttnContext.attend`); it may exchange
        per-batch metadata (document ids) once here, for all layers."""
        ...


def _allowed(ctx: AttnContext, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor | None:
    """The context's boolean mask, materializing the implicit causal one when needed."""
    if ctx.mask is None and ctx.is_causal:
        return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - q_len)
    return ctx.mask


class PerformerFeatures(nn.Module):
    """FAVOR+ positive orthogonal random features (Choromanski et al. 2021) for one head size."""

    def __init__(self, head_dim: int, n_features: int) -> None:
        super().__init__()
        self.head_dim, self.n_features = head_dim, n_features
        self.register_buffer("projection", torch.empty(n_features, head_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw blocks of orthogonal rows, scaled to the norms of Gaussian vectors."""
        d = self.head_dim
        blocks = []
        for _ in range(-(-self.n_features // d)):
            q, _ = torch.linalg.qr(torch.randn(d, d, device=self.projection.device))
            blocks.append(q.T)
        rows = torch.cat(blocks)[: self.n_features]
        norms = torch.randn(self.n_features, d, device=self.projection.device).norm(dim=-1, keepdim=True)
        with torch.no_grad():
            self.projection.copy_(rows * norms)

    def forward(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        """phi(x) = exp(w.x - |x|^2 / 2) / sqrt(m), with x scaled by d^-1/4 and a cancelling stabilizer."""
        x = x.float() * self.head_dim**-0.25
        proj = x @ self.projection.T
        sq = x.pow(2).sum(-1, keepdim=True) / 2
        # Subtracting a max per query row, or one max over all keys, cancels in numerator / denominator.
        stab = proj.amax(dim=-1, keepdim=True) if is_query else proj.amax(dim=(-1, -2), keepdim=True)
        return torch.exp(proj - sq - stab) / math.sqrt(self.n_features) + 1e-6


def linear_attention(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """sum_j phi(q_i).phi(k_j) v_j / sum_j phi(q_i).phi(k_j), over j <= i when causal (prefix sums)."""
    v = v.float()
    if not causal:
        kv = torch.einsum("bhtf,bhtd->bhfd", phi_k, v)
        num = torch.einsum("bhtf,bhfd->bhtd", phi_q, kv)
        den = torch.einsum("bhtf,bhf->bht", phi_q, phi_k.sum(2))
    else:
        q_len = phi_q.shape[2]
        kv = torch.einsum("bhtf,bhtd->bhtfd", phi_k, v).cumsum(2)[:, :, -q_len:]
        num = torch.einsum("bhtf,bhtfd->bhtd", phi_q, kv)
        den = torch.einsum("bhtf,bhtf->bht", phi_q, phi_k.cumsum(2)[:, :, -q_len:])
    return num / den[..., None].clamp_min(1e-12)


class Attention(nn.Module):
    """Self- or cross-attention; ``n_kv_heads`` < ``n_heads`` gives GQA (1 gives MQA)."""

    def __init__(self, cfg: ModelConfig, cross: bool = False) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads or cfg.n_heads
        self.head_dim = cfg.head_dim or cfg.dim // cfg.n_heads
        self.scale = cfg.attention.scale or 1.0 / math.sqrt(self.head_dim)
        self.kernel, self.cross, self.attn_dropout = cfg.attention.kernel, cross, cfg.attention.dropout
        # Gated attention (Qwen3-Next): q_proj also yields a gate per head, laid out [q_h, gate_h] head by head.
        self.output_gate = cfg.attention.output_gate and not cross
        q_width = self.n_heads * self.head_dim * (2 if self.output_gate else 1)
        self.q_proj = nn.Linear(cfg.dim, q_width, bias=cfg.attention.qkv_bias)
        self.k_proj = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=cfg.attention.qkv_bias)
        self.v_proj = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=cfg.attention.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.dim, bias=cfg.bias or cfg.attention.o_bias)
        # Per head (Qwen3) or over all heads' channels of the projection (OLMoE: qk_norm_scope = "all").
        self.qk_norm_all = cfg.attention.qk_norm_scope == "all"
        q_width, k_width = (self.n_heads, self.n_kv_heads) if self.qk_norm_all else (1, 1)
        qk_norm = ZeroCenteredRMSNorm if cfg.norm == "zero_centered_rmsnorm" else RMSNorm
        self.q_norm = qk_norm(q_width * self.head_dim, cfg.norm_eps) if cfg.attention.qk_norm else None
        self.k_norm = qk_norm(k_width * self.head_dim, cfg.norm_eps) if cfg.attention.qk_norm else None
        self.features = (
            PerformerFeatures(self.head_dim, cfg.attention.performer_features)
            if cfg.attention.kernel == "performer"
            else None
        )
        # Set only while a tool inspects attention (eager kernel): called with each forward's weights.
        self.weights_observer: Callable[[torch.Tensor], None] | None = None
        # Set only while QK-clip (tessera/train/qk_clip.py) watches the logits: called with q, k and the context.
        self.qk_observer: Callable[[torch.Tensor, torch.Tensor, AttnContext], None] | None = None

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, heads * head_dim) -> (B, heads, T, head_dim); the head count follows the projection's
        width, so a tensor-parallel shard holding 1/tp of the heads needs no bookkeeping."""
        return x.view(x.shape[0], x.shape[1], -1, self.head_dim).transpose(1, 2)

    def forward(
        self,
        x: torch.Tensor,
        ctx: AttnContext,
        cache: KVCache | None = None,
        start: int = 0,
        memory: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend from ``x`` (B, T, dim) to itself (or to ``memory`` for cross-attention)."""
        b, t, _ = x.shape
        src = memory if self.cross else x
        q, k = self.q_proj(x), self.k_proj(src)
        gate = None
        if self.output_gate:
            q, gate = q.view(b, t, -1, 2 * self.head_dim).chunk(2, dim=-1)
            q, gate = q.reshape(b, t, -1), gate.reshape(b, t, -1)
        if self.q_norm is not None and self.qk_norm_all:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = self._heads(q), self._heads(k), self._heads(self.v_proj(src))
        if self.q_norm is not None and not self.qk_norm_all:
            q, k = self.q_norm(q), self.k_norm(k)
        if ctx.cos is not None and not self.cross:
            q, k = apply_rope(q, ctx.cos, ctx.sin), apply_rope(k, ctx.cos, ctx.sin)
        if self.qk_observer is not None:
            self.qk_observer(q, k, ctx)
        if cache is not None:
            k, v = cache.update(k, v, start)
        out = ctx.attend(self, q, k, v, ctx) if ctx.attend is not None else self.attend(q, k, v, ctx)
        out = out.transpose(1, 2).reshape(b, t, -1)
        return self.o_proj(out * torch.sigmoid(gate) if gate is not None else out)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        """The kernel: (B, H, Tq, D) queries over (B, H_kv, Tk, D) keys/values under ``ctx``'s mask."""
        if self.kernel in LINEAR_KERNELS:
            return self._linear(q, k, v, ctx)
        dropout = self.attn_dropout if self.training else 0.0
        if ctx.blocks is not None:
            return block_sparse_attention(q, k, v, ctx.blocks, self.scale, dropout)
        if self.kernel != "eager":
            gqa = k.shape[1] != q.shape[1]
            if ctx.bias is None:
                return F.scaled_dot_product_attention(
                    q,
                    k,
                    v,
                    attn_mask=ctx.mask,
                    dropout_p=dropout,
                    is_causal=ctx.is_causal,
                    scale=self.scale,
                    enable_gqa=gqa,
                )
            allowed = _allowed(ctx, q.shape[2], k.shape[2], q.device)
            bias = ctx.bias.to(q.dtype)
            mask = bias if allowed is None else bias.masked_fill(~allowed, float("-inf"))
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, scale=self.scale, enable_gqa=gqa
            )
        return self._eager(q, k, v, ctx, dropout)

    @staticmethod
    def _repeat_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rep = q.shape[1] // k.shape[1]
        return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)

    def _eager(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttnContext, dropout: float
    ) -> torch.Tensor:
        k, v = self._repeat_kv(q, k, v)
        scores = (q.float() @ k.float().transpose(-2, -1)) * self.scale
        if ctx.bias is not None:
            scores = scores + ctx.bias
        mask = _allowed(ctx, q.shape[2], k.shape[2], q.device)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        weights = scores.softmax(dim=-1)
        if self.weights_observer is not None:
            self.weights_observer(weights.detach())
        weights = F.dropout(weights, p=dropout, training=dropout > 0)
        return (weights @ v.float()).to(q.dtype)

    def _linear(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        if ctx.mask is not None or ctx.bias is not None:
            raise ValueError(
                f"model.attention='{self.kernel}' supports only causal or full attention (no document_ids, windows or "
                "score biases)"
            )
        k, v = self._repeat_kv(q, k, v)
        if self.features is not None:
            phi_q, phi_k = self.features(q, is_query=True), self.features(k, is_query=False)
        else:
            phi_q, phi_k = F.elu(q.float()) + 1, F.elu(k.float()) + 1
        if self.weights_observer is not None:  # the implicit weights phi(q).phi(k) / sum_k, exactly as applied
            scores = phi_q @ phi_k.transpose(-2, -1)
            scores = scores.tril(scores.shape[-1] - scores.shape[-2]) if ctx.causal else scores
            self.weights_observer(scores / scores.sum(-1, keepdim=True).clamp_min(1e-12))
        return linear_attention(phi_q, phi_k, v, ctx.causal).to(q.dtype)
