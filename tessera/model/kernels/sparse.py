"""``longformer`` and ``bigbird``: sdpa over a sparse pattern (masks.py: a local window plus global
tokens; BigBird adds random key blocks), run block-sparse over whole sequences."""

from __future__ import annotations

from typing import Any

from tessera.config.checks import require
from tessera.model.kernels.common import SOFTMAX_TERMS
from tessera.model.kernels.sdpa import sdpa_attend
from tessera.registry import ATTENTION_TP, KernelSpec, register, uses_kernel

FEATURE = "sparse attention kernels (longformer, bigbird)"
KEYS = ("model.attention.kernel", "model.attention.sliding_window", "model.attention.global_tokens")


def check_longformer(m: Any) -> None:
    """Longformer's local width is the sliding window."""
    require(
        m.attention.sliding_window > 0,
        "model.attention.kernel='longformer' needs model.attention.sliding_window > 0 (the local width)",
    )


LONGFORMER = register(
    KernelSpec(
        name="longformer",
        feature=FEATURE,
        keys=KEYS,
        uses=uses_kernel("longformer"),
        unsupported={},
        checks=(check_longformer,),
        terms=SOFTMAX_TERMS,
        tp_plan=ATTENTION_TP,
        attend=sdpa_attend,
        pattern=True,
    )
)

BIGBIRD = register(
    KernelSpec(
        name="bigbird",
        feature=FEATURE,
        keys=(*KEYS, "model.attention.block_size", "model.attention.random_blocks"),
        uses=uses_kernel("bigbird"),
        unsupported={},
        checks=(),
        terms=SOFTMAX_TERMS,
        tp_plan=ATTENTION_TP,
        attend=sdpa_attend,
        pattern=True,
    )
)
