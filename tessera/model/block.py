"""One block: a mixer (attention, latent attention, Mamba or Gated DeltaNet), optional cross-attention, then a
dense FFN or MoE.

Pre-norm (``x + f(norm(x))``, GPT-2/Llama/T5), post-norm (``norm(x + f(x))``, BERT), sandwich
(``x + post(f(norm(x)))``, Gemma 2/3) or reordered (``x + norm(f(x))``, OLMo 2/3). Which mixer
a layer gets is the letter of ``model.layer_pattern`` at its index (see :func:`layer_kind`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tessera import registry
from tessera.config import ModelConfig
from tessera.model.attention import Attention, AttnContext, KVCache, SlidingKVCache
from tessera.model.attention import layer_attention_config  # noqa: F401  (re-exported)
from tessera.model.mixers import layer_kind, mixer_for  # noqa: F401  (layer_kind re-exported)
from tessera.model.ffn import FeedForward, ffn_hidden_size
from tessera.model.mamba import MambaCache
from tessera.model.mla import LatentCache
from tessera.model.moe import MoE, is_moe_layer
from tessera.model.norm import build_norm
from tessera.registry import MixerSpec

LayerCache = KVCache | SlidingKVCache | LatentCache | MambaCache


class TransformerBlock(nn.Module):
    """A mixer (+ cross-attention) and a feed-forward sublayer with residuals and dropout.

    Attention layers hold ``attention_norm``/``attention``; Mamba layers ``mamba_norm``/``mamba``; Gated
    DeltaNet layers ``gdn_norm``/``gdn`` (the others are None). ``moe`` or ``feed_forward`` is the FFN; a
    Mamba layer without one (``[model.mamba].ffn = false``, as in Mamba itself) has neither.
    """

    def __init__(self, cfg: ModelConfig, layer_id: int = 0, cross: bool = False) -> None:
        super().__init__()
        self.kind = layer_kind(cfg, layer_id)
        self.norm_position = cfg.norm_position  # pre | post | sandwich | reordered (see _sublayer)
        self.attention_norm = self.attention = self.mamba_norm = self.mamba = self.gdn_norm = self.gdn = None
        # The registry's mixer for this layer's letter; it sits at ``<attr>`` with its norm at ``<attr>_norm``.
        spec = mixer_for(cfg, layer_id)
        self.mixer = spec.name  # a name, not the spec: the module stays picklable
        setattr(self, f"{spec.attr}_norm", build_norm(cfg.norm, cfg.dim, cfg.norm_eps))
        setattr(self, spec.attr, spec.build(cfg, layer_id))
        self.cross_attention_norm = build_norm(cfg.norm, cfg.dim, cfg.norm_eps) if cross else None
        self.cross_attention = Attention(cfg, cross=True) if cross else None
        has_ffn = spec.has_ffn(cfg)
        self.ffn_norm = build_norm(cfg.norm, cfg.dim, cfg.norm_eps) if has_ffn else None
        # Sandwich norms (Gemma 2/3): each sublayer's output is normed too, before the residual add.
        sandwich = cfg.norm_position == "sandwich"
        setattr(self, f"{spec.attr}_post_norm", build_norm(cfg.norm, cfg.dim, cfg.norm_eps) if sandwich else None)
        self.ffn_post_norm = build_norm(cfg.norm, cfg.dim, cfg.norm_eps) if sandwich and has_ffn else None
        # At most one of the two is set: a block says what it contains (parallel plans ask).
        self.moe: MoE | None = MoE(cfg) if has_ffn and is_moe_layer(cfg, layer_id) else None
        self.feed_forward: FeedForward | None = None
        if has_ffn and self.moe is None:
            hidden = ffn_hidden_size(cfg.dim, cfg.activation, cfg.ffn_hidden, cfg.ffn_multiplier, cfg.multiple_of)
            bias = cfg.bias or cfg.ffn_bias
            multipliers = (cfg.mup.ffn_gate, cfg.mup.ffn_down)  # muP (Falcon-H1); 1.0 = off
            self.feed_forward = FeedForward(cfg.dim, hidden, cfg.activation, bias, cfg.dropout, multipliers)
        self.jitter = cfg.moe.jitter
        self.dropout = nn.Dropout(cfg.dropout)

    @property
    def mixer_spec(self) -> MixerSpec:
        """This layer's registered mixer (see tessera.registry.MixerSpec)."""
        return registry.get("mixer", self.mixer)

    def _sublayer(
        self,
        x: torch.Tensor,
        norm: nn.Module,
        fn: Callable[[torch.Tensor], torch.Tensor],
        post: nn.Module | None = None,
    ) -> torch.Tensor:
        """One residual sublayer with its norm where ``model.norm_position`` puts it (``post``: sandwich's second)."""
        if self.norm_position == "post":
            return norm(x + self.dropout(fn(x)))
        if self.norm_position == "reordered":
            return x + self.dropout(norm(fn(x)))
        out = fn(norm(x))
        return x + self.dropout(post(out) if post is not None else out)

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
        spec = self.mixer_spec
        mixer, norm = getattr(self, spec.attr), getattr(self, f"{spec.attr}_norm")
        post = getattr(self, f"{spec.attr}_post_norm", None)
        x = self._sublayer(x, norm, lambda h: spec.forward(mixer, h, ctx, cache, start), post)
        if self.cross_attention is not None:
            x = self._sublayer(
                x,
                self.cross_attention_norm,
                lambda h: self.cross_attention(h, cross_ctx or AttnContext(), memory=memory),
            )
        if self.moe is not None:
            return self._sublayer(x, self.ffn_norm, lambda h: self._moe(h, ctx), self.ffn_post_norm)
        if self.feed_forward is not None:
            return self._sublayer(x, self.ffn_norm, self.feed_forward, self.ffn_post_norm)
        return x

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device) -> LayerCache:
        """An empty decoding cache of this layer's mixer (KV, latent or SSM state) for ``max_len`` positions."""
        return self.mixer_spec.new_cache(getattr(self, self.mixer_spec.attr), batch, max_len, dtype, device)
