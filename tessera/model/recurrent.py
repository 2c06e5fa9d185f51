"""What the recurrent mixers (Mamba, Mamba-2, Gated DeltaNet) share: the causal depthwise convolution with
document resets, and the document masks of a chunked scan."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
