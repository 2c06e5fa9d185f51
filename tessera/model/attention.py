"""Multi-head attention with grouped/multi-query heads, RoPE, a KV cache and two kernels.

``sdpa`` calls ``F.scaled_dot_product_attention`` (flash/memory-efficient on GPU); ``eager``
writes the softmax(QK^T/sqrt(d))V product out, in float32, and keeps the weights for inspection.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tessera.model.position import RotaryEmbedding, apply_rope


class KVCache:
    """Preallocated keys and values of one attention layer for incremental decoding."""

    def __init__(self, batch: int, n_kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def update(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write positions ``start..start+T-1`` and return all keys/values up to there."""
        end = start + k.shape[2]
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


def _causal_mask(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """Boolean (q_len, kv_len) mask, True where attention is allowed; queries are the last q_len."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    return torch.arange(kv_len, device=device)[None, :] <= q_pos


class Attention(nn.Module):
    """Self-attention; ``n_kv_heads`` < ``n_heads`` gives GQA (1 gives MQA)."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        kernel: str = "sdpa",
        qkv_bias: bool = False,
        attn_dropout: float = 0.0,
        causal: bool = True,
    ) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = dim // n_heads
        self.kernel, self.causal, self.attn_dropout = kernel, causal, attn_dropout
        self.q_proj = nn.Linear(dim, n_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(dim, n_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(dim, n_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        self.last_weights: torch.Tensor | None = None

    def forward(
        self,
        x: torch.Tensor,
        rope: RotaryEmbedding | None = None,
        cache: KVCache | None = None,
        start: int = 0,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        if rope is not None:
            cos, sin = rope(start, t)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, start)
        out = self._attend(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q_len, kv_len = q.shape[2], k.shape[2]
        dropout = self.attn_dropout if self.training else 0.0
        mask = None
        if self.causal and q_len > 1:
            mask = _causal_mask(q_len, kv_len, q.device)
        if self.kernel == "eager":
            return self._eager(q, k, v, mask, dropout)
        gqa = self.n_kv_heads != self.n_heads
        if mask is not None and q_len == kv_len:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, enable_gqa=gqa)

    def _eager(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout: float) -> torch.Tensor:
        rep = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        weights = scores.softmax(dim=-1)
        self.last_weights = weights.detach()
        weights = F.dropout(weights, p=dropout, training=dropout > 0)
        return (weights @ v.float()).to(q.dtype)
