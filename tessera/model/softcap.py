"""Gemma's scaled embeddings and Gemma 2's soft-capping, as HF's Gemma modules compute them.

- ``model.embed_scale``: token embeddings times sqrt(dim), the factor rounded to the embedding's dtype
  first (HF's ``Gemma3TextScaledWordEmbedding``: in bf16, sqrt(2560) = 50.596 becomes 50.5).
- ``model.attention.softcap``: every attention score ``s`` becomes ``cap * tanh(s / cap)`` before the
  mask (HF's ``attn_logit_softcapping``); only the eager kernel writes the scores out to cap them.
- ``model.logit_softcap``: the head's logits capped the same way (``final_logit_softcapping``); the
  fused head + loss (tessera.train.loss) reads the head's ``cap`` and caps each chunk of logits.

The embedding and the head are subclasses of ``nn.Embedding`` / ``nn.Linear`` with the same parameter
names, so tensor parallelism, tied weights, checkpoints and HF mappings see the modules they expect.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tessera.config import ModelConfig
from tessera.config.checks import require
from tessera.model.mup import MultipliedEmbedding
from tessera.registry import register_options


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)``: ``x`` squashed smoothly into (-cap, cap)."""
    return torch.tanh(x / cap) * cap


class ScaledEmbedding(nn.Embedding):
    """Token embeddings times ``scale`` rounded to the weight's dtype (Gemma's sqrt(dim))."""

    def __init__(self, num_embeddings: int, embedding_dim: int, scale: float) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.scale = scale

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # A Python float of the rounded factor: a plain tensor would not mix with a tensor-parallel DTensor.
        factor = float(torch.tensor(self.scale, dtype=self.weight.dtype))
        return super().forward(tokens) * factor


class SoftcappedHead(nn.Linear):
    """The output head with its logits soft-capped (Gemma 2's ``final_logit_softcapping``)."""

    def __init__(self, in_features: int, out_features: int, cap: float) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.cap = cap

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return softcap(super().forward(h), self.cap)


def token_embedding(cfg: ModelConfig) -> nn.Embedding:
    """A decoder's token embedding: scaled by sqrt(dim) under ``model.embed_scale``."""
    if cfg.embed_scale:
        return ScaledEmbedding(cfg.vocab_size, cfg.dim, cfg.dim**0.5)
    if cfg.mup.embedding != 1.0:  # muP (Falcon-H1's embedding_multiplier): the factor as given, unrounded
        return MultipliedEmbedding(cfg.vocab_size, cfg.dim, cfg.mup.embedding)
    return nn.Embedding(cfg.vocab_size, cfg.dim)


def output_head(cfg: ModelConfig) -> nn.Linear:
    """A decoder's output head: soft-capped under ``model.logit_softcap``."""
    if cfg.logit_softcap > 0:
        return SoftcappedHead(cfg.dim, cfg.vocab_size, cfg.logit_softcap)
    return nn.Linear(cfg.dim, cfg.vocab_size, bias=False)


def check_attention_softcap(m: Any) -> None:
    """Attention soft-capping needs the scores written out: the eager kernel."""
    cap = m.attention.softcap
    require(cap >= 0, f"model.attention.softcap must be >= 0 (0 = off), got {cap}")
    require(
        not cap or m.attention.kernel == "eager",
        f"model.attention.softcap={cap} needs the scores written out, which model.attention.kernel="
        f"'{m.attention.kernel}' does not do; set model.attention.kernel = \"eager\"",
    )
    require(not cap or not m.mla.kv_rank, "model.attention.softcap is for standard attention, not model.mla")


def check_logit_softcap(m: Any) -> None:
    """Final-logit soft-capping: a decoder's head."""
    cap = m.logit_softcap
    require(cap >= 0, f"model.logit_softcap must be >= 0 (0 = off), got {cap}")
    require(not cap or m.arch == "decoder", f"model.logit_softcap is for decoders, not model.arch='{m.arch}'")


def check_sublayer_norms(m: Any) -> None:
    """Sandwich and reordered norms: decoder blocks (no cross-attention sublayer to norm)."""
    require(
        m.norm_position in ("pre", "post") or m.arch == "decoder",
        f"model.norm_position='{m.norm_position}' is for decoders, not model.arch='{m.arch}'",
    )


def check_embed_scale(m: Any) -> None:
    """Scaled embeddings: a decoder's token embedding."""
    require(not m.embed_scale or m.arch == "decoder", f"model.embed_scale is for decoders, not model.arch='{m.arch}'")


_CP_SOFTCAP = "the ring-attention core of context parallelism merges uncapped sdpa blocks; run softcap without cp"


def _sublayer_norms_used(m: Any) -> bool:
    return m.norm_position in ("sandwich", "reordered")


register_options(
    {
        "attention_softcap": ("attention soft-capping (Gemma 2)", "model.attention.softcap", check_attention_softcap),
        "logit_softcap": ("final-logit soft-capping (Gemma 2)", "model.logit_softcap", check_logit_softcap),
        "embed_scale": ("embeddings scaled by sqrt(dim) (Gemma)", "model.embed_scale", check_embed_scale),
        "sublayer_norms": (
            "sandwich / reordered sublayer norms",
            "model.norm_position",
            check_sublayer_norms,
            _sublayer_norms_used,
        ),
    },
    unsupported={"attention_softcap": {"cp": _CP_SOFTCAP}},
)
