"""Per-layer attention patterns: local and global layers with their own RoPE, and NoPE layers.

Which layer is local or global is its ``model.layer_pattern`` letter: 'A' layers attend within
``model.attention.sliding_window``, 'G' layers attend globally (Gemma 3's "AAAAAG", OLMo 3's "AAAG").
On top of that, two [model.position] keys shape each layer's rotary embedding:

- ``local_rope_theta``: the 'A' layers get their own plain RoPE at this base (no ``rope_scaling``), the
  'G' layers keep ``rope_theta`` and its scaling (Gemma 3: local 10000, global 1e6 x linear 8).
- ``nope_layers``: these layers get no rotary at all (SmolLM3's ``no_rope_layers``, Llama 4's iRoPE);
  their window is still their letter's.

The stack builds one attention context per (letter, rotary) combination a forward needs and hands
each layer its own (:func:`layer_context`); everything else (masks, caches, context parallelism)
already follows the letter.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from tessera import registry
from tessera.config import ModelConfig
from tessera.config.checks import require
from tessera.model.position import RotaryEmbedding

if TYPE_CHECKING:
    from tessera.model.kernels.common import AttnContext


def nope_layers(m: ModelConfig) -> frozenset[int]:
    """The layer indices of ``model.position.nope_layers`` (unchecked: :func:`check_nope_layers` says why not)."""
    text = m.position.nope_layers.replace(" ", "")
    return frozenset(int(part) for part in text.split(",")) if text else frozenset()


def local_rotary(m: ModelConfig, head_dim: int) -> RotaryEmbedding | None:
    """The local ('A') layers' own plain RoPE (``model.position.local_rope_theta``), or None."""
    if m.position.kind != "rope" or not m.position.local_rope_theta:
        return None
    return RotaryEmbedding(head_dim, m.max_seq_len, m.position.local_rope_theta, fraction=m.position.rotary_fraction)


def layer_context(
    layer_id: int,
    letter: str,
    contexts: dict[str, AttnContext],
    local_tables: tuple[torch.Tensor, torch.Tensor] | None,
    nope: frozenset[int],
    cache: dict[tuple[str, bool], AttnContext],
) -> AttnContext:
    """The context of layer ``layer_id``: its letter's masking (``contexts``: 'A' and 'G'), the local RoPE
    tables on an 'A' layer when there are any, no rotary on a NoPE layer. ``cache`` shares each
    combination between the layers of one forward."""
    key = (letter if letter == "G" else "A", layer_id in nope)
    if key not in cache:
        ctx = contexts[key[0]]
        if key[1]:
            ctx = dataclasses.replace(ctx, cos=None, sin=None)
        elif key[0] == "A" and local_tables is not None:
            ctx = dataclasses.replace(ctx, cos=local_tables[0], sin=local_tables[1])
        cache[key] = ctx
    return cache[key]


def check_nope_layers(m: Any) -> None:
    """``model.position.nope_layers``: distinct layer indices of a RoPE decoder of standard attention."""
    text = m.position.nope_layers
    if not text:
        return
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",")]
    except ValueError:
        ids = []
    require(
        bool(ids) and len(set(ids)) == len(ids),
        f'model.position.nope_layers={text!r} is not a list of distinct layer indices; write e.g. "3,7,11"',
    )
    bad = [i for i in ids if not 0 <= i < m.n_layers]
    require(
        not bad,
        f"model.position.nope_layers has layer {bad[0] if bad else 0}, out of range for model.n_layers={m.n_layers}; "
        f"use indices 0..{m.n_layers - 1}",
    )
    require(
        m.position.kind == "rope" and m.arch == "decoder" and not m.mla.kv_rank,
        "model.position.nope_layers needs model.position.kind='rope' in a decoder of standard attention "
        "(not model.mla)",
    )


def check_local_rope(m: Any) -> None:
    """``model.position.local_rope_theta``: a RoPE model with both local ('A', windowed) and global ('G') layers."""
    theta = m.position.local_rope_theta
    if not theta:
        return
    require(theta > 0, f"model.position.local_rope_theta must be positive (0 = off), got {theta}")
    require(
        m.position.kind == "rope" and m.attention.sliding_window > 0 and "G" in m.layer_pattern and not m.mla.kv_rank,
        "model.position.local_rope_theta is the RoPE base of the local 'A' layers: it needs model.position.kind="
        "'rope', model.attention.sliding_window > 0 and 'G' layers in model.layer_pattern (e.g. \"AAAAAG\")",
    )


registry.register_options(
    {
        "nope_layers": ("NoPE layers (no rotary on chosen layers)", "model.position.nope_layers", check_nope_layers),
        "local_rope": (
            "per-layer RoPE base (local/global layers)",
            "model.position.local_rope_theta",
            check_local_rope,
        ),
    }
)
