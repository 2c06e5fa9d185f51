"""One block: a mixer (attention, latent attention, Mamba or Gated DeltaNet), optional cross-attention, then a
dense FFN or MoE.

Pre-norm (``x + f(norm(x))``, GPT-2/Llama/T5) or post-norm (``norm(x + f(x))``, BERT). Which mixer
a layer gets is the letter of ``model.layer_pattern`` at its index (see :func:`layer_kind`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from tessera.config import ModelConfig, layer_heads
from tessera.model.attention import Attention, AttnContext, KVCache, SlidingKVCache
from tessera.model.ffn import FeedForward, ffn_hidden_size
from tessera.model.gated_deltanet import GatedDeltaNet
from tessera.model.mamba import MambaCache, build_mamba
from tessera.model.mla import LatentAttention, LatentCache
from tessera.model.moe import MoE, is_moe_layer
from tessera.model.norm import build_norm

LayerCache = KVCache | SlidingKVCache | LatentCache | MambaCache


def layer_kind(cfg: ModelConfig, layer_id: int) -> str:
    """The ``model.layer_pattern`` letter of layer ``layer_id``: A (attention), G (global attention), M (Mamba),
    D (Gated DeltaNet)."""
    pattern = cfg.layer_pattern or "A"
    return pattern[layer_id % len(pattern)]


def layer_attention_config(cfg: ModelConfig, layer_id: int) -> ModelConfig:
    """``cfg`` with layer ``layer_id``'s query and KV head counts (``model.attention.heads_per_layer``:
    whole GQA groups, so the group size and the head size stay the model's)."""
    if not cfg.attention.heads_per_layer:
        return cfg
    heads = layer_heads(cfg)[layer_id]
    kv = heads * (cfg.n_kv_heads or cfg.n_heads) // cfg.n_heads
    return dataclasses.replace(cfg, n_heads=heads, n_kv_heads=kv, head_dim=cfg.head_dim or cfg.dim // cfg.n_heads)


class TransformerBlock(nn.Module):
    """A mixer (+ cross-attention) and a feed-forward sublayer with residuals and dropout.

    Attention layers hold ``attention_norm``/``attention``; Mamba layers ``mamba_norm``/``mamba``; Gated
    DeltaNet layers ``gdn_norm``/``gdn`` (the others are None). ``moe`` or ``feed_forward`` is the FFN; a
    Mamba layer without one (``[model.mamba].ffn = false``, as in Mamba itself) has neither.
    """

    def __init__(self, cfg: ModelConfig, layer_id: int = 0, cross: bool = False) -> None:
        super().__init__()
        self.kind = layer_kind(cfg, layer_id)
        self.post_norm = cfg.norm_position == "post"
        self.attention_norm = self.attention = self.mamba_norm = self.mamba = self.gdn_norm = self.gdn = None
        if self.kind == "M":
            self.mamba_norm = build_norm(cfg.norm, cfg.dim, cfg.norm_eps)
            self.mamba = build_mamba(cfg)
        elif self.kind == "D":
            self.gdn_norm = build_norm(cfg.norm, cfg.dim, cfg.norm_eps)
            self.gdn = GatedDeltaNet(cfg)
        else:
            self.attention_norm = build_norm(cfg.norm, cfg.dim, cfg.norm_eps)
            self.attention = (
                LatentAttention(cfg) if cfg.mla.kv_rank else Attention(layer_attention_config(cfg, layer_id))
            )
            if cfg.attention.scale_by_layer:
                self.attention.scale /= layer_id + 1
        self.cross_attention_norm = build_norm(cfg.norm, cfg.dim, cfg.norm_eps) if cross else None
        self.cross_attention = Attention(cfg, cross=True) if cross else None
        has_ffn = self.kind != "M" or cfg.mamba.ffn
        self.ffn_norm = build_norm(cfg.norm, cfg.dim, cfg.norm_eps) if has_ffn else None
        # At most one of the two is set: a block says what it contains (parallel plans ask).
        self.moe: MoE | None = MoE(cfg) if has_ffn and is_moe_layer(cfg, layer_id) else None
        self.feed_forward: FeedForward | None = None
        if has_ffn and self.moe is None:
            hidden = ffn_hidden_size(cfg.dim, cfg.activation, cfg.ffn_hidden, cfg.ffn_multiplier, cfg.multiple_of)
            bias = cfg.bias or cfg.ffn_bias
            self.feed_forward = FeedForward(cfg.dim, hidden, cfg.activation, bias=bias, dropout=cfg.dropout)
        self.jitter = cfg.moe.jitter
        self.dropout = nn.Dropout(cfg.dropout)

    def _sublayer(self, x: torch.Tensor, norm: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        if self.post_norm:
            return norm(x + self.dropout(fn(x)))
        return x + self.dropout(fn(norm(x)))

    def _moe(self, h: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        if self.training and self.jitter > 0:  # Mixtral: multiplicative noise on the routed input
            h = h * torch.empty_like(h).uniform_(1.0 - self.jitter, 1.0 + self.jitter)
        return self.moe(h, ctx.moe_log)

    def forward(
        self,
        x: torch.Tensor,
        ctx: AttnContext,
        cache: LayerCache | None = None,
        start: int = 0,
        memory: torch.Tensor | None = None,
        cross_ctx: AttnContext | None = None,
    ) -> torch.Tensor:
        """The block applied to ``x`` (B, T, dim); ``memory`` is the encoder output for cross-attention."""
        if self.mamba is not None:
            x = self._sublayer(x, self.mamba_norm, lambda h: self.mamba(h, cache, start, ctx.document_ids))
        elif self.gdn is not None:
            x = self._sublayer(x, self.gdn_norm, lambda h: self.gdn(h, cache, start, ctx.document_ids))
        else:
            x = self._sublayer(x, self.attention_norm, lambda h: self.attention(h, ctx, cache, start))
        if self.cross_attention is not None:
            x = self._sublayer(
                x,
                self.cross_attention_norm,
                lambda h: self.cross_attention(h, cross_ctx or AttnContext(), memory=memory),
            )
        if self.moe is not None:
            return self._sublayer(x, self.ffn_norm, lambda h: self._moe(h, ctx))
        if self.feed_forward is not None:
            return self._sublayer(x, self.ffn_norm, self.feed_forward)
        return x

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device) -> LayerCache:
        """An empty decoding cache of this layer's mixer (KV, latent or SSM state) for ``max_len`` positions."""
        if self.mamba is not None:
            return self.mamba.new_cache(batch, device)
        if self.gdn is not None:
            return self.gdn.new_cache(batch, device)
        if isinstance(self.attention, LatentAttention):
            return self.attention.new_cache(batch, max_len, dtype, device)
        return KVCache(batch, self.attention.n_kv_heads, self.attention.head_dim, max_len, dtype, device)
