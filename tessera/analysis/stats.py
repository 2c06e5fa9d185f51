"""Per-head statistics of attention maps: entropy, mean distance, attention sinks, previous-token heads."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

COLUMNS = ("entropy", "mean_distance", "first_token", "previous_token")


@dataclass
class HeadStats:
    """One head's map summarized over its query rows (distance and previous token: self-attention only)."""

    head: int
    entropy: float  # nats, mean over query rows (0 = all weight on one key)
    mean_distance: float  # sum_k w_qk |q - k|, mean over rows, in tokens
    first_token: float  # mean weight on the first key (an attention sink when large)
    previous_token: float  # mean weight on key q - 1 (rows q >= 1)


def row_entropy(weights: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of each attention row: (..., Tq, Tk) -> (..., Tq); 0 log 0 counts as 0."""
    return torch.special.entr(weights.float()).sum(-1)


def head_stats(maps: torch.Tensor, self_attention: bool = True) -> list[HeadStats]:
    """Statistics of each head of ``maps`` (H, Tq, Tk) whose row q is query position q (keys from 0)."""
    maps = maps.float()
    n_heads, tq, tk = maps.shape
    nan = torch.full((n_heads,), float("nan"))
    entropy = row_entropy(maps).mean(-1)
    first = maps[..., 0].mean(-1)
    distance, previous = nan, nan
    if self_attention:
        offset = tk - tq  # the rows are the last tq of tk positions
        q_pos = torch.arange(offset, tk, dtype=torch.float32)
        gap = (q_pos[:, None] - torch.arange(tk, dtype=torch.float32)[None]).abs()
        distance = (maps * gap).sum(-1).mean(-1)
        rows = torch.arange(tq)[q_pos >= 1]
        if len(rows):
            previous = maps[:, rows, rows + offset - 1].mean(-1)
    return [
        HeadStats(h, entropy[h].item(), distance[h].item(), first[h].item(), previous[h].item()) for h in range(n_heads)
    ]


def format_table(stats: list[HeadStats]) -> list[str]:
    """Aligned text rows: head, entropy, mean distance, first-token and previous-token shares."""
    lines = ["  head  entropy  mean dist  first token  previous token"]
    for s in stats:
        cells = [f"{s.entropy:7.3f}", _num(s.mean_distance, 9, 2), _num(s.first_token, 11, 3)]
        lines.append(f"  {s.head:4d}  " + "  ".join(cells) + "  " + _num(s.previous_token, 14, 3))
    return lines


def _num(value: float, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if math.isnan(value) else f"{value:{width}.{digits}f}"
