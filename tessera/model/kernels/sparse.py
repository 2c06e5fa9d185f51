"""``longformer`` and ``bigbird``: sdpa over a sparse pattern (a local window plus global tokens; BigBird
adds random key blocks), run block-sparse over whole sequences. Each pattern is its spec's
``pattern`` (a :class:`tessera.model.masks.Pattern`), which masks.py draws."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from tessera.config.checks import require
from tessera.model.kernels.common import SOFTMAX_TERMS
from tessera.model.masks import MaskSpec, near, neighbour_slots, window_block, window_slots
from tessera.model.kernels.sdpa import sdpa_attend
from tessera.registry import ATTENTION_TP, KernelSpec, register, uses_kernel

FEATURE = "sparse attention kernels (longformer, bigbird)"
KEYS = ("model.attention.kernel", "model.attention.sliding_window", "model.attention.global_tokens")


# BigBird's random blocks come from this fixed seed, so every layer, step and process agrees.
_BIGBIRD_SEED = 0


def _is_global(spec: MaskSpec, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return (q < spec.global_tokens) | (k < spec.global_tokens)


@dataclass(frozen=True)
class LongformerPattern:
    """A local window of ``sliding_window`` keys either side, plus ``global_tokens`` global positions."""

    def allowed(self, spec: MaskSpec, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """The local window or a global position."""
        return near(q, k, spec.window) | _is_global(spec, q, k)

    def n_global(self, spec: MaskSpec) -> int:
        """The global tokens."""
        return spec.global_tokens

    def block(self, spec: MaskSpec) -> int:
        """Blocks of the sliding window's edge."""
        return window_block(spec)

    def key_slots(self, spec: MaskSpec, block: int, n_blocks: int, device: torch.device) -> torch.Tensor:
        """The key blocks the window reaches."""
        return window_slots(spec, block, n_blocks, device)


@functools.lru_cache(maxsize=8)
def _bigbird_order(n_blocks: int) -> torch.Tensor:
    """(n_blocks, n_blocks) key blocks of each query block in random order (fixed per size)."""
    gen = torch.Generator().manual_seed(_BIGBIRD_SEED)
    return torch.rand(n_blocks, n_blocks, generator=gen).argsort(dim=-1)


def _bigbird_random(n_blocks: int, random_blocks: int, device: torch.device) -> torch.Tensor:
    """(n_blocks, n_blocks) bool: the random key blocks of each query block (fixed per size)."""
    picked = torch.zeros(n_blocks, n_blocks, dtype=torch.bool)
    picked.scatter_(1, _bigbird_order(n_blocks)[:, :random_blocks], True)
    return picked.to(device)


@dataclass(frozen=True)
class BigBirdPattern:
    """Blocks of ``block_size``: each query block sees its neighbour blocks, ``random_blocks`` random ones
    (fixed per size) and the global positions."""

    def _blocks(self, spec: MaskSpec) -> int:
        return -(-spec.max_len // spec.block_size)

    def allowed(self, spec: MaskSpec, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Neighbour blocks, random blocks or a global position."""
        n_blocks = self._blocks(spec)
        bq, bk = (q // spec.block_size).clamp(0, n_blocks - 1), (k // spec.block_size).clamp(0, n_blocks - 1)
        rand = _bigbird_random(n_blocks, spec.random_blocks, q.device)[bq, bk]
        return near(bq, bk, 2) | _is_global(spec, q, k) | rand

    def n_global(self, spec: MaskSpec) -> int:
        """The global tokens."""
        return spec.global_tokens

    def block(self, spec: MaskSpec) -> int:
        """``model.attention.block_size``."""
        return spec.block_size

    def key_slots(self, spec: MaskSpec, block: int, n_blocks: int, device: torch.device) -> torch.Tensor:
        """The neighbour blocks, then the random ones."""
        slots = neighbour_slots(spec, 1, n_blocks, device)
        if not spec.random_blocks:
            return slots
        order = _bigbird_order(self._blocks(spec))[:, : spec.random_blocks].to(device)
        rows = torch.arange(n_blocks, device=device).clamp(max=order.shape[0] - 1)
        return torch.cat([slots, order[rows]], dim=1)


def check_longformer(m: Any) -> None:
    """Longformer's local width is the sliding window."""
    require(
        m.attention.sliding_window > 0,
        "model.attention.kernel='longformer' needs model.attention.sliding_window > 0 (the local width)",
    )


def _sparse_kernel(name: str, pattern: Any, keys: tuple[str, ...], checks: tuple) -> KernelSpec:
    """A kernel of this file: sdpa (block-sparse) over ``pattern``; one table row, every layout supported."""
    return register(
        KernelSpec(
            name=name,
            feature=FEATURE,
            keys=(*KEYS, *keys),
            uses=uses_kernel(name),
            unsupported={},
            checks=checks,
            terms=SOFTMAX_TERMS,
            tp_plan=ATTENTION_TP,
            attend=sdpa_attend,
            pattern=pattern,
        )
    )


LONGFORMER = _sparse_kernel("longformer", LongformerPattern(), (), (check_longformer,))
BIGBIRD = _sparse_kernel(
    "bigbird", BigBirdPattern(), ("model.attention.block_size", "model.attention.random_blocks"), checks=()
)
