"""What the recurrent mixers (Mamba, Mamba-2, Gated DeltaNet, the linear attention kernels) share: the causal
depthwise convolution with document resets, the document masks of a chunked scan, and a scan over a sequence split
across ranks (context parallelism: each piece summarized from a zero state, the summaries combined in order, each
piece scanned again from the state entering it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


class MambaCache:
    """One Mamba layer's decoding state: the last ``conv - 1`` convolution inputs and the SSM state."""

    def __init__(self, batch: int, conv_dim: int, conv: int, state_shape: tuple[int, ...], device: torch.device):
        self.conv = torch.zeros(batch, conv_dim, conv - 1, device=device)
        self.ssm = torch.zeros(batch, *state_shape, device=device)

    def bytes(self) -> int:
        """Memory of the state (fixed, whatever the context length)."""
        return sum(t.numel() * t.element_size() for t in (self.conv, self.ssm))


def causal_depthwise_conv(x: torch.Tensor, weight: torch.Tensor, document_ids: torch.Tensor | None) -> torch.Tensor:
    """Causal depthwise convolution of ``x`` (B, C, T) with ``weight`` (C, 1, W), no bias or activation.

    With ``document_ids`` (B, T) a position sees only the inputs of its own document (the window
    restarts at every boundary).
    """
    width, length = weight.shape[-1], x.shape[-1]
    padded = F.pad(x, (width - 1, 0))
    if document_ids is None:
        return F.conv1d(padded, weight, groups=x.shape[1])
    docs = F.pad(document_ids, (width - 1, 0), value=-1)
    out = torch.zeros_like(x)
    for w in range(width):
        same = (docs[:, w : w + length] == document_ids)[:, None]  # (B, 1, T)
        out = out + weight[:, 0, w, None] * padded[..., w : w + length] * same
    return out


def continues_document(document_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: position t belongs to the document of position t - 1 (True at t = 0: the entering state's)."""
    same = document_ids[:, 1:] == document_ids[:, :-1]
    return torch.cat([torch.ones_like(same[:, :1]), same], dim=1)


def chunk_document_masks(ids: torch.Tensor, before: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Masks of one chunked-scan step from the chunks' ids (..., L) and the id of the position before each chunk
    (...): same-document pairs (..., L, L), whether a position reads the entering state (..., L), writes the
    leaving one (..., L), and whether the state crosses the chunk (...)."""
    same = ids[..., :, None] == ids[..., None, :]
    reads = ids == before[..., None]
    writes = ids == ids[..., -1:]
    carries = ids[..., -1] == before
    return same, reads, writes, carries


class RecurrentSplit(Protocol):
    """A forward that holds only some pieces of each sequence (context parallelism implements it from outside):
    what a recurrent mixer needs from the other pieces."""

    def pieces(self, length: int) -> list[slice]:
        """The local tokens as contiguous pieces of the whole sequence, in local order."""
        ...

    def halos(self, tails: torch.Tensor) -> torch.Tensor:
        """(B, C, pieces, W) the last W inputs of each local piece -> the W inputs before each (zeros at the
        sequence's start), from whichever rank holds them."""
        ...

    def entering_states(
        self, transitions: torch.Tensor, contributions: torch.Tensor, elementwise: bool = False
    ) -> torch.Tensor:
        """Each local piece's summary - the state transition A and the state it adds from zero, H (pieces, B, ...),
        so that S_end = A S_in + H (a matrix product (..., Dk, Dk) @ (..., Dk, Dv), or with ``elementwise`` a
        broadcast product) -> the state entering each local piece (pieces, B, ...): a prefix over the pieces of
        all ranks in sequence order."""
        ...

    def maximum(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise maximum of ``x`` over every piece of the sequence (no gradient)."""
        ...


def split_document_halos(document_ids: torch.Tensor, split: RecurrentSplit, width: int) -> torch.Tensor:
    """(pieces, B, width) the document ids of the ``width`` positions before each local piece (-1 before the
    sequence's start)."""
    tails = torch.stack([document_ids[:, p][:, -width:] for p in split.pieces(document_ids.shape[1])], dim=1)
    halos = split.halos((tails + 1).to(torch.float64)[:, None])  # 0 marks "no position"
    return (halos[:, 0].round().long() - 1).transpose(0, 1)


def split_causal_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    split: RecurrentSplit,
    document_ids: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`causal_depthwise_conv` (+ ``bias``) of a split sequence's local (B, C, T): each piece's window
    starts with the halo of inputs before it (cut at a document boundary with ``document_ids``)."""
    width = weight.shape[-1]
    pieces = split.pieces(x.shape[-1])
    halos = split.halos(torch.stack([x[..., p][..., x[..., p].shape[-1] - (width - 1) :] for p in pieces], dim=2))
    before = split_document_halos(document_ids, split, width - 1) if document_ids is not None else None
    outs = []
    for i, p in enumerate(pieces):
        full = torch.cat([halos[:, :, i], x[..., p]], -1)
        if before is None:
            out = F.conv1d(full, weight, groups=x.shape[1])
        else:
            out = causal_depthwise_conv(full, weight, torch.cat([before[i], document_ids[:, p]], -1))[..., width - 1 :]
        outs.append(out if bias is None else out + bias[:, None])
    return torch.cat(outs, dim=-1)


def split_scan(
    split: RecurrentSplit,
    length: int,
    summarize: Callable[[slice], tuple[torch.Tensor, torch.Tensor]],
    scan: Callable[[slice, torch.Tensor], torch.Tensor],
    elementwise: bool,
    document_ids: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """A recurrence over a split sequence: ``summarize(piece)`` scans a local piece from a zero state to its
    (transition, contribution) (pieces, B, ...); the split combines the summaries of every piece in order; each
    piece is scanned again, ``scan(piece, entering state)``, and its outputs returned in local order.

    With ``document_ids`` the summaries reset inside a piece themselves (their own document masks); a piece whose
    first position starts a document neither passes on nor receives the state before it."""
    pieces = split.pieces(length)
    summaries = [summarize(p) for p in pieces]
    transitions, contributions = (torch.stack(parts) for parts in zip(*summaries))
    continues = None
    if document_ids is not None:
        before = split_document_halos(document_ids, split, 1)[..., 0]  # (pieces, B)
        firsts = torch.stack([document_ids[:, p][:, 0] for p in pieces])
        continues = (before == firsts).to(contributions.dtype)
        transitions = transitions * continues.view(*continues.shape, *[1] * (transitions.dim() - 2))
    entering = split.entering_states(transitions, contributions, elementwise)
    if continues is not None:
        entering = entering * continues.view(*continues.shape, *[1] * (entering.dim() - 2))
    return [scan(p, entering[i]) for i, p in enumerate(pieces)]


Docs = torch.Tensor | None  # (B, T) document ids of packed sequences, or None


class RecurrentMixer(nn.Module):
    """A token mixer with a recurrent state (Mamba, Mamba-2, Gated DeltaNet): one calling convention."""

    def forward(
        self,
        x: torch.Tensor,
        cache: MambaCache | None = None,
        start: int = 0,
        document_ids: torch.Tensor | None = None,
        split: RecurrentSplit | None = None,
    ) -> torch.Tensor:
        """Mix ``x`` (B, T, dim) along time; with ``cache``, continue a sequence at position ``start``; with
        ``document_ids`` (B, T), restart the state and the convolution at every document boundary; with
        ``split``, ``x`` is this forward's part of each sequence (context parallelism)."""
        return self.mix(x, cache, start, document_ids, split)

    def mix(self, x: torch.Tensor, cache: MambaCache | None, start: int, docs: Docs, split: RecurrentSplit | None):
        """The mixer itself (see :meth:`forward`)."""
        raise NotImplementedError
