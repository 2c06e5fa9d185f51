"""muP multipliers outside the mixers (``[model.mup]``, Falcon-H1's): forward-time factors on the token embeddings,
the logits, and each FFN's gate and output. Like the parallel hybrid's own (tessera/model/parallel_hybrid.py) they
are never folded into the weights: under muP they scale the gradients as well.

The logits' factor is applied to the final norm's output, on the last pipeline stage only (the same logits: the
head has no bias), so the fused head + loss, which reads the head's weight, sees it too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tessera.config.checks import require
from tessera.registry import register_options

MUP_KEYS = ("embedding", "head", "ffn_gate", "ffn_down")


class MultipliedEmbedding(nn.Embedding):
    """Token embeddings times ``multiplier`` (HF's ``embed_tokens(ids) * embedding_multiplier``)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, multiplier: float) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.multiplier = multiplier

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return super().forward(tokens) * self.multiplier


def mup_used(m: Any) -> bool:
    """Whether any ``[model.mup]`` factor differs from 1."""
    return any(getattr(m.mup, key) != 1.0 for key in MUP_KEYS)


def check_mup(m: Any) -> None:
    """[model.mup]: finite, nonzero factors; a decoder's; the FFN factors on dense FFNs only."""
    for key in MUP_KEYS:
        value = getattr(m.mup, key)
        require(
            value == value and abs(value) not in (0.0, float("inf")),
            f"model.mup.{key} must be a finite nonzero factor (1 = off), got {value}",
        )
    if not mup_used(m):
        return
    require(m.arch == "decoder", f"[model.mup] multipliers are for decoders, not model.arch='{m.arch}'")
    require(
        m.mup.head == 1.0 or m.norm_position != "post",
        "model.mup.head scales the final norm's output, which model.norm_position='post' has none of; use 'pre'",
    )
    require(
        not m.embed_scale or m.mup.embedding == 1.0,
        "model.mup.embedding and model.embed_scale both scale the embeddings; keep one",
    )
    require(
        m.moe.experts <= 1 or (m.mup.ffn_gate == 1.0 and m.mup.ffn_down == 1.0),
        "model.mup.ffn_gate / ffn_down scale dense FFNs only; model.moe.experts > 1 has expert banks",
    )


register_options({"mup": ("muP multipliers (embedding, logits, FFN; Falcon-H1)", "model.mup", check_mup, mup_used)})
