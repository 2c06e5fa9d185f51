"""One transformer block: pre-norm attention and feed-forward with residual connections."""

from __future__ import annotations

import torch
from torch import nn

from tessera.config import ModelConfig
from tessera.model.attention import Attention, KVCache
from tessera.model.ffn import FeedForward, ffn_hidden_size
from tessera.model.norm import build_norm
from tessera.model.position import RotaryEmbedding


class TransformerBlock(nn.Module):
    """x + attn(norm(x)), then + ffn(norm(x)), with residual dropout."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = build_norm(cfg.norm, cfg.dim, cfg.norm_eps)
        self.attention = Attention(
            cfg.dim,
            cfg.n_heads,
            cfg.n_kv_heads or cfg.n_heads,
            kernel=cfg.attention,
            qkv_bias=cfg.qkv_bias,
            attn_dropout=cfg.attn_dropout,
        )
        self.ffn_norm = build_norm(cfg.norm, cfg.dim, cfg.norm_eps)
        hidden = ffn_hidden_size(cfg.dim, cfg.activation, cfg.ffn_hidden, cfg.ffn_multiplier, cfg.multiple_of)
        self.feed_forward = FeedForward(cfg.dim, hidden, cfg.activation, dropout=cfg.dropout)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding | None = None, cache: KVCache | None = None, start: int = 0) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.attention_norm(x), rope, cache, start))
        return x + self.dropout(self.feed_forward(self.ffn_norm(x)))
