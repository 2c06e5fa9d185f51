"""One transformer block: self-attention, optional cross-attention, then a dense FFN or MoE.

Pre-norm (``x + f(norm(x))``, GPT-2/Llama/T5) or post-norm (``norm(x + f(x))``, BERT).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tessera.config import ModelConfig
from tessera.model.attention import Attention, AttnContext, KVCache
from tessera.model.ffn import FeedForward, ffn_hidden_size
from tessera.model.moe import MoE, is_moe_layer
from tessera.model.norm import build_norm


class TransformerBlock(nn.Module):
    """Attention (+ cross-attention) and feed-forward sublayers with residuals and dropout."""

    def __init__(self, cfg: ModelConfig, layer_id: int = 0, cross: bool = False) -> None:
        super().__init__()
        self.post_norm = cfg.norm_position == "post"
        self.attention_norm = build_norm(cfg.norm, cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.cross_attention_norm = build_norm(cfg.norm, cfg.dim, cfg.norm_eps) if cross else None
        self.cross_attention = Attention(cfg, cross=True) if cross else None
        self.ffn_norm = build_norm(cfg.norm, cfg.dim, cfg.norm_eps)
        # Exactly one of the two is set: a block says what it contains (parallel plans ask).
        self.moe: MoE | None = MoE(cfg) if is_moe_layer(cfg, layer_id) else None
        self.feed_forward: FeedForward | None = None
        if self.moe is None:
            hidden = ffn_hidden_size(cfg.dim, cfg.activation, cfg.ffn_hidden, cfg.ffn_multiplier, cfg.multiple_of)
            self.feed_forward = FeedForward(cfg.dim, hidden, cfg.activation, bias=cfg.bias, dropout=cfg.dropout)
        self.dropout = nn.Dropout(cfg.dropout)

    def _sublayer(self, x: torch.Tensor, norm: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        if self.post_norm:
            return norm(x + self.dropout(fn(x)))
        return x + self.dropout(fn(norm(x)))

    def forward(
        self,
        x: torch.Tensor,
        ctx: AttnContext,
        cache: KVCache | None = None,
        start: int = 0,
        memory: torch.Tensor | None = None,
        cross_ctx: AttnContext | None = None,
    ) -> torch.Tensor:
        """The block applied to ``x`` (B, T, dim); ``memory`` is the encoder output for cross-attention."""
        x = self._sublayer(x, self.attention_norm, lambda h: self.attention(h, ctx, cache, start))
        if self.cross_attention is not None:
            x = self._sublayer(
                x,
                self.cross_attention_norm,
                lambda h: self.cross_attention(h, cross_ctx or AttnContext(), memory=memory),
            )
        if self.moe is not None:
            return self._sublayer(x, self.ffn_norm, lambda h: self.moe(h, ctx.moe_log))
        return self._sublayer(x, self.ffn_norm, self.feed_forward)
