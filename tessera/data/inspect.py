"""``tessera data inspect``: what an indexed dataset holds, at a glance."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tessera.data.dataset import open_indexed
from tessera.data.prepare import tokenizer_sidecar
from tessera.data.tokenizer import Tokenizer

BAR_WIDTH = 40


def length_histogram(lengths: np.ndarray) -> list[tuple[int, int, int]]:
    """Document counts in power-of-two length buckets: ``(low, high, count)`` for ``low <= len < high``."""
    top = int(np.ceil(np.log2(max(int(lengths.max()), 1) + 1)))
    edges = [0] + [2**k for k in range(1, top + 1)]
    counts, _ = np.histogram(lengths, bins=edges)
    return [(int(lo), int(hi), int(c)) for lo, hi, c in zip(edges[:-1], edges[1:], counts)]


def inspect_dataset(prefix: str | Path, tokenizer: str = "", samples: int = 3, sample_chars: int = 300) -> str:
    """A report of ``prefix.bin/.idx``: documents, tokens, length statistics and histogram, samples.

    Samples are decoded with ``tokenizer`` (default: the ``prefix.tokenizer.model`` that
    ``tessera prepare`` keeps); without one, token ids are shown.
    """
    prefix = str(prefix).removesuffix(".bin").removesuffix(".idx")
    indexed = open_indexed(prefix)
    lengths = indexed.sequence_lengths.astype(np.int64)
    tok_path = Path(tokenizer) if tokenizer else tokenizer_sidecar(prefix)
    tok = Tokenizer(tok_path) if tokenizer or tok_path.is_file() else None
    lines = [
        f"dataset     {prefix}.bin/.idx ({np.dtype(indexed.index.dtype).name} tokens)",
        f"documents   {len(lengths):,}",
        f"tokens      {int(lengths.sum()):,}",
        f"doc length  min {lengths.min():,}  mean {lengths.mean():,.1f}  median {int(np.median(lengths)):,}  max {lengths.max():,}",
        "length histogram (tokens per document):",
    ]
    histogram = length_histogram(lengths)
    peak = max(c for _, _, c in histogram)
    for lo, hi, count in histogram:
        if count:
            lines.append(f"  [{lo:>7,}, {hi:>7,})  {count:>9,}  {'#' * max(1, round(BAR_WIDTH * count / peak))}")
    picks = np.unique(np.linspace(0, len(lengths) - 1, num=min(samples, len(lengths))).astype(int))
    for doc in picks:
        ids = indexed.get(int(doc))
        head = f"sample: document {doc} ({len(ids)} tokens)"
        body = tok.decode(ids.tolist())[:sample_chars] if tok else " ".join(map(str, ids[:64].tolist()))
        lines += [head + ("" if tok else ", token ids (no tokenizer; pass --tokenizer)"), "  " + body.replace("\n", "\n  ")]
    return "\n".join(lines)
