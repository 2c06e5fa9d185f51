"""Which keys each query may see: causal, sliding window, documents, Longformer and BigBird patterns.

Masks are boolean, True where attention is allowed, shaped (B or 1, 1, Tq, Tk). Queries are the
last ``Tq`` of ``Tk`` positions (index ``start + i``), so the same code serves training and
KV-cached decoding. The sparse patterns are applied as masks over dense scores: the numbers are
those of the sparse kernels, the memory is not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# BigBird's random blocks come from this fixed seed, so every layer, step and process agrees.
_BIGBIRD_SEED = 0


@dataclass
class MaskSpec:
    """The ``[model]`` keys that shape a self-attention mask."""

    kernel: str = "sdpa"
    causal: bool = True
    window: int = 0
    global_tokens: int = 0
    block_size: int = 16
    random_blocks: int = 1
    max_len: int = 2048


def _bigbird_random(n_blocks: int, random_blocks: int, device: torch.device) -> torch.Tensor:
    """(n_blocks, n_blocks) bool: the random key blocks of each query block (fixed per size)."""
    gen = torch.Generator().manual_seed(_BIGBIRD_SEED)
    order = torch.rand(n_blocks, n_blocks, generator=gen).argsort(dim=-1)[:, :random_blocks]
    picked = torch.zeros(n_blocks, n_blocks, dtype=torch.bool)
    picked.scatter_(1, order, True)
    return picked.to(device)


def _pattern(spec: MaskSpec, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """The kernel's own (Tq, Tk) pattern before causality and documents, or None for all keys."""
    dist = q[:, None] - k[None, :]
    if spec.kernel == "longformer":
        is_global = (q[:, None] < spec.global_tokens) | (k[None, :] < spec.global_tokens)
        return (dist.abs() < spec.window) | is_global
    if spec.kernel == "bigbird":
        bq, bk = q // spec.block_size, k // spec.block_size
        n_blocks = -(-spec.max_len // spec.block_size)
        rand = _bigbird_random(n_blocks, spec.random_blocks, q.device)[bq][:, bk]
        is_global = (q[:, None] < spec.global_tokens) | (k[None, :] < spec.global_tokens)
        return ((bq[:, None] - bk[None, :]).abs() <= 1) | is_global | rand
    if spec.window > 0:
        return dist.abs() < spec.window
    return None


def attention_mask(
    spec: MaskSpec, q_len: int, kv_len: int, device: torch.device, document_ids: torch.Tensor | None = None
) -> torch.Tensor | None:
    """Boolean mask (B or 1, 1, q_len, kv_len), or None when every query may see every key it
    would under plain causal attention over a square (q_len == kv_len) block, or all keys."""
    q = torch.arange(kv_len - q_len, kv_len, device=device)
    k = torch.arange(kv_len, device=device)
    mask = _pattern(spec, q, k)
    if mask is None and document_ids is None and q_len == 1:  # one decoding step: the last query sees every key
        return None
    if spec.causal and (mask is not None or q_len != kv_len or document_ids is not None):
        causal = k[None, :] <= q[:, None]
        mask = causal if mask is None else mask & causal
    if document_ids is not None:
        if q_len != kv_len:
            raise ValueError("document_ids cannot be combined with a KV cache; pass them for full sequences only")
        same = document_ids[:, :, None] == document_ids[:, None, :]
        mask = same if mask is None else mask[None] & same
        return mask[:, None]
    return None if mask is None else mask[None, None]


def left_padding_mask(
    mask: torch.Tensor | None, causal: bool, left_pad: torch.Tensor, q_len: int, kv_len: int, kv_start: int = 0
) -> torch.Tensor:
    """``mask`` (None: plain causal, or all keys) with each row's first ``left_pad[b]`` positions hidden as keys,
    shaped (B, 1, q_len, keys); queries are the last ``q_len`` of positions ``kv_start .. kv_len - 1``.

    A query always sees its own position, so the rows of padding queries stay finite (their outputs are
    never read by a real token).
    """
    device = left_pad.device
    q = torch.arange(kv_len - q_len, kv_len, device=device)
    k = torch.arange(kv_start, kv_len, device=device)
    if mask is None:
        mask = k[None, :] <= q[:, None] if causal else torch.ones(q_len, k.numel(), dtype=torch.bool, device=device)
    mask = mask & (k[None, :] >= left_pad[:, None])[:, None, None, :]
    return mask | (k[None, :] == q[:, None])


def left_padded_positions(left_pad: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """(B, length) positions of cache slots ``start ..`` counted from each row's first real token (0 on padding)."""
    slots = torch.arange(start, start + length, device=left_pad.device)
    return (slots[None, :] - left_pad[:, None]).clamp_min(0)
