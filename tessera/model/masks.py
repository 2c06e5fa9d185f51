"""Which keys each query may see: causal, sliding window, documents, and the patterns kernels bring.

One rule, :func:`allowed`, decides for any query and key positions (broadcast tensors), so the same
code serves whole sequences, KV-cached decoding (queries are the last ``Tq`` of the keys), the
blocks of the block-sparse kernels and context parallelism's global token indices. Masks are
boolean, True where attention is allowed.

A kernel that brings its own sparsity pattern (Longformer, BigBird: ``tessera/model/kernels/sparse.py``)
declares it as its ``KernelSpec.pattern``, a :class:`Pattern`; this module reads it through the registry
and names no kernel.

:func:`attention_mask` is the dense (Tq, Tk) mask. :func:`block_layout` is the block-sparse plan of
the windowed patterns (a sliding window or a kernel's pattern): queries in blocks, each attending only
the key blocks its pattern can reach plus the global tokens, so memory and work grow as
O(length x window) instead of O(length^2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tessera import registry

# Block edge of the sliding-window kernels: a query block reaches ceil((window - 1) / block) blocks back.
_WINDOW_BLOCK = 128


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
    chunk: int = 0  # > 0: queries see only keys of their own fixed chunk (Llama 4, tessera/model/attention_chunks.py)

    @property
    def pattern(self) -> Pattern | None:
        """The kernel's own sparsity pattern (its ``KernelSpec.pattern``), or None."""
        return registry.get("attention_kernel", self.kernel).pattern

    @property
    def windowed(self) -> bool:
        """Whether the pattern limits each query to nearby keys (plus global and random ones)."""
        return self.pattern is not None or self.window > 0

    @property
    def n_global(self) -> int:
        """Positions that attend and are attended everywhere (a pattern's global tokens)."""
        pattern = self.pattern
        return pattern.n_global(self) if pattern is not None else 0


class Pattern(Protocol):
    """A kernel's own sparsity pattern (``KernelSpec.pattern``), over the keys of a :class:`MaskSpec`."""

    def allowed(self, spec: MaskSpec, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Bool (broadcast): the keys at positions ``k`` queries at ``q`` see, before causality and documents."""
        ...

    def n_global(self, spec: MaskSpec) -> int:
        """Positions that attend and are attended everywhere."""
        ...

    def block(self, spec: MaskSpec) -> int:
        """The block edge of its block-sparse plan."""
        ...

    def key_slots(self, spec: MaskSpec, block: int, n_blocks: int, device: torch.device) -> torch.Tensor:
        """(n_blocks, slots) key-block ids of each query block (may repeat or fall outside the sequence)."""
        ...


def near(q: torch.Tensor, k: torch.Tensor, reach: int) -> torch.Tensor:
    """|q - k| < reach, by comparisons only (no pairwise integer difference is materialized)."""
    return (k > q - reach) & (k < q + reach)


def window_block(spec: MaskSpec) -> int:
    """The block edge of a sliding window's (or chunks') block-sparse plan."""
    return min(spec.window or spec.chunk, _WINDOW_BLOCK)


def neighbour_slots(spec: MaskSpec, reach: int, n_blocks: int, device: torch.device) -> torch.Tensor:
    """(n_blocks, slots) ids of the key blocks ``reach`` blocks back (and ahead, unless causal) of each query block."""
    offsets = torch.arange(-reach, (0 if spec.causal else reach) + 1, device=device)
    return torch.arange(n_blocks, device=device)[:, None] + offsets


def _reach(spec: MaskSpec, block: int) -> int:
    """Key blocks back a query block needs: a window's width, or its chunk's start (a whole number of blocks back
    when blocks tile the chunks, else a chunk-wide window, whose earlier chunks' keys :func:`allowed` drops)."""
    if spec.window or spec.chunk % block:
        return -(-((spec.window or spec.chunk) - 1) // block)
    return spec.chunk // block - 1


def window_slots(spec: MaskSpec, block: int, n_blocks: int, device: torch.device) -> torch.Tensor:
    """The key blocks a sliding window of ``spec.window`` keys (or a chunk) reaches from each query block."""
    return neighbour_slots(spec, _reach(spec, block), n_blocks, device)


def _pattern(spec: MaskSpec, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """The kernel's own pattern before causality and documents (broadcast), or None for all keys."""
    pattern = spec.pattern
    if pattern is not None:
        return pattern.allowed(spec, q, k)
    if spec.window > 0:
        return near(q, k, spec.window)
    if spec.chunk > 0:
        return torch.div(q, spec.chunk, rounding_mode="floor") == torch.div(k, spec.chunk, rounding_mode="floor")
    return None


def allowed(
    spec: MaskSpec,
    q: torch.Tensor,
    k: torch.Tensor,
    q_doc: torch.Tensor | None = None,
    k_doc: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bool, True where a query at position ``q`` may attend a key at position ``k``.

    All arguments broadcast against each other (e.g. ``q`` (Tq, 1), ``k`` (1, Tk), documents
    (B, Tq, 1) and (B, 1, Tk)); positions are indices in the full sequence.
    """
    ok = _pattern(spec, q, k)
    if spec.causal:
        ok = k <= q if ok is None else ok & (k <= q)
    if q_doc is not None:
        same = q_doc == k_doc
        ok = same if ok is None else ok & same
    if ok is None:
        ok = torch.ones(torch.broadcast_shapes(q.shape, k.shape), dtype=torch.bool, device=q.device)
    return ok


def attention_mask(
    spec: MaskSpec,
    q_len: int,
    kv_len: int,
    device: torch.device,
    document_ids: torch.Tensor | None = None,
    kv_start: int = 0,
) -> torch.Tensor | None:
    """Boolean mask (B or 1, 1, q_len, kv_len), or None when every query may see every key it
    would under plain causal attention over a square (q_len == kv_len) block, or all keys.

    Keys are positions ``kv_start .. kv_start + kv_len - 1`` (a sliding-window cache keeps only
    the last ones), queries the last ``q_len`` of them.
    """
    # No mask: full self-attention, one decoding step (the last query sees every key), or non-causal; chunks
    # matter only once the keys cross a chunk boundary (a training sequence within one chunk is plain causal).
    chunked = spec.chunk > 0 and kv_start + kv_len > spec.chunk
    if not spec.windowed and not chunked and document_ids is None and (q_len in (kv_len, 1) or not spec.causal):
        return None
    k = torch.arange(kv_start, kv_start + kv_len, device=device)
    q = k[kv_len - q_len :]
    if document_ids is not None:
        if q_len != kv_len:
            raise ValueError("document_ids cannot be combined with a KV cache; pass them for full sequences only")
        return allowed(spec, q[:, None], k[None, :], document_ids[:, :, None], document_ids[:, None, :])[:, None]
    return allowed(spec, q[:, None], k[None, :])[None, None]


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


@dataclass
class BlockLayout:
    """The block-sparse plan of one forward, shared by all its layers.

    Query block ``i`` (``block`` positions) attends the key blocks ``key_blocks[i]`` and the
    first ``n_global`` keys, under ``mask`` (B or 1, n_blocks, block, slots * block + n_global);
    the first ``n_global`` queries attend every key they may, under ``global_mask``
    (B or 1, 1, n_global, length). Padded query positions (past ``length``) attend only themselves.
    """

    block: int
    length: int
    key_blocks: torch.Tensor
    mask: torch.Tensor
    n_global: int = 0
    global_mask: torch.Tensor | None = None

    @property
    def n_blocks(self) -> int:
        """Query (and key) blocks of the padded sequence."""
        return self.key_blocks.shape[0]

    @property
    def keys_per_query(self) -> int:
        """Keys each query block scores: its key blocks and the global keys."""
        return self.mask.shape[-1]


def _key_slots(spec: MaskSpec, block: int, n_blocks: int, device: torch.device) -> torch.Tensor:
    """(n_blocks, slots) key-block ids of each query block: the blocks its pattern (or window) reaches
    (ids may repeat or fall outside the sequence: see _unique_in_range)."""
    pattern = spec.pattern
    if pattern is not None:
        return pattern.key_slots(spec, block, n_blocks, device)
    return window_slots(spec, block, n_blocks, device)


def _unique_in_range(slots: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """(n_blocks, slots) bool: the slot names a real block not named by an earlier slot of its row."""
    ok = (slots >= 0) & (slots < n_blocks)
    earlier = (slots[:, :, None] == slots[:, None, :]).tril(-1).any(-1)
    return ok & ~earlier


def block_layout(
    spec: MaskSpec, length: int, device: torch.device, document_ids: torch.Tensor | None = None
) -> BlockLayout | None:
    """The block-sparse plan of ``spec``'s pattern over ``length`` tokens, or None when the pattern
    is dense (no window or chunks) or its blocks would score as many keys as dense attention."""
    if not spec.windowed and not spec.chunk:
        return None
    n_global = min(spec.n_global, length)
    block = spec.pattern.block(spec) if spec.pattern is not None else window_block(spec)
    n_blocks = -(-length // block)
    slots = _key_slots(spec, block, n_blocks, device)
    if slots.shape[1] * block + n_global >= length:
        return None
    key_blocks = slots.clamp(0, n_blocks - 1)
    q = torch.arange(n_blocks * block, device=device).view(n_blocks, block, 1)
    k = (key_blocks[:, :, None] * block + torch.arange(block, device=device)).view(n_blocks, 1, -1)
    g = torch.arange(n_global, device=device)
    docs = _padded_documents(document_ids, n_blocks * block)  # (B, padded) or None
    q_doc = None if docs is None else docs.view(-1, n_blocks, block, 1)
    k_doc = None if docs is None else docs[:, k]
    g_doc = None if docs is None else docs[:, None, None, :n_global]
    key_ok = (
        _unique_in_range(slots, n_blocks).repeat_interleave(block, dim=1)[:, None, :] & (k < length) & (k >= n_global)
    )
    local = allowed(spec, q, k, q_doc, k_doc) & key_ok
    local = local | ((q >= length) & (k == q))  # padding queries see themselves: no empty softmax rows
    glob = allowed(spec, q, g, q_doc, g_doc)
    mask = torch.cat([local, glob], dim=-1).view(-1, n_blocks, block, local.shape[-1] + n_global)
    rows = None
    if n_global:
        row_doc = None if docs is None else (docs[:, :n_global, None], docs[:, None, :length])
        rows = allowed(spec, g[:, None], torch.arange(length, device=device), *(row_doc or ())).view(
            -1, 1, n_global, length
        )
    return BlockLayout(block, length, key_blocks, mask, n_global, rows)


def _padded_documents(document_ids: torch.Tensor | None, padded: int) -> torch.Tensor | None:
    """Document ids (B, padded), padding positions in a document of their own (-1)."""
    if document_ids is None:
        return None
    return torch.nn.functional.pad(document_ids, (0, padded - document_ids.shape[1]), value=-1)
