"""Attention heatmaps: one PNG grid per layer, one panel per head, token strings on both axes."""

from __future__ import annotations

import math
from pathlib import Path

import torch


def _panel_inches(n_tokens: int) -> float:
    return max(2.4, 0.1 * n_tokens + 0.8)


def draw_layer(
    maps: torch.Tensor,
    heads: list[int],
    queries: list[str],
    keys: list[str],
    title: str,
    path: Path,
    split: int | None = None,
    dpi: int = 100,
) -> Path:
    """Draw ``maps`` (H, Tq, Tk) of ``heads`` into ``path``; a dashed line after query row ``split`` marks
    where generated tokens begin. Each panel is scaled to its own maximum."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(len(heads), 4)
    rows = math.ceil(len(heads) / cols)
    size = _panel_inches(max(len(queries), len(keys)))
    font = 7 if max(len(queries), len(keys)) <= 48 else 5
    fig, axes = plt.subplots(rows, cols, figsize=(cols * size, rows * size + 0.5), dpi=dpi, squeeze=False)
    for ax in axes.flat[len(heads) :]:
        ax.axis("off")
    for ax, head in zip(axes.flat, heads):
        ax.imshow(maps[head].float().numpy(), cmap="viridis", vmin=0.0, interpolation="nearest", aspect="auto")
        ax.set_title(f"head {head}", fontsize=font + 2)
        ax.set_xticks(range(len(keys)), keys, rotation=90, fontsize=font)
        ax.set_yticks(range(len(queries)), queries, fontsize=font)
        ax.tick_params(length=0)
        if split is not None and 0 < split < len(queries):
            ax.axhline(split - 0.5, color="white", linestyle="--", linewidth=0.8)
    fig.suptitle(title, fontsize=font + 4)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def display_tokens(pieces: list[str]) -> list[str]:
    """Token strings as drawn: SentencePiece's word marker as a visible space, long pieces shortened."""
    shown = [p.replace("\u2581", "\u2423").replace("\u0120", "\u2423") for p in pieces]
    return [p if len(p) <= 12 else p[:11] + "\u2026" for p in shown]
