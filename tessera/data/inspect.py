"""``tessera data inspect``: what an indexed dataset holds, at a glance; and the realized mix of a blend."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np

from tessera.data.blend import BlendedSamples
from tessera.data.dataset import open_indexed
from tessera.data.loader import SequenceLoader
from tessera.data.prepare import file_sha256, tokenizer_record, tokenizer_sidecar
from tessera.data.tokenizer import Tokenizer

BAR_WIDTH = 40


def length_histogram(lengths: np.ndarray) -> list[tuple[int, int, int]]:
    """Document counts in power-of-two length buckets: ``(low, high, count)`` for ``low <= len < high``."""
    top = int(np.ceil(np.log2(max(int(lengths.max()), 1) + 1)))
    edges = [0] + [2**k for k in range(1, top + 1)]
    counts, _ = np.histogram(lengths, bins=edges)
    return [(int(lo), int(hi), int(c)) for lo, hi, c in zip(edges[:-1], edges[1:], counts)]


def recorded_tokenizer(prefix: str) -> dict:
    """What ``tessera prepare`` recorded about the tokenizer of ``prefix`` (empty when nothing was)."""
    path = tokenizer_record(prefix)
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        return {}


def find_tokenizer(prefix: str, given: str = "") -> tuple[Tokenizer | None, str]:
    """The tokenizer to decode ``prefix`` with and a line saying which and why.

    ``given`` wins; else the copy ``tessera prepare`` kept beside the dataset; else the recorded
    original path when its hash still matches.
    """
    if given:
        return Tokenizer(given), f"{given} (--tokenizer)"
    record = recorded_tokenizer(prefix)
    want = record.get("sha256", "")
    candidates = [tokenizer_sidecar(prefix)] + ([Path(record["path"])] if record.get("path") else [])
    for candidate in candidates:
        if candidate.is_file() and (not want or file_sha256(candidate) == want):
            origin = f", recorded by tessera prepare from {record['path']}" if record else ""
            return Tokenizer(candidate), f"{candidate} (sha256 {file_sha256(candidate)[:12]}{origin})"
    if record:
        return None, f"recorded {record.get('path')} (sha256 {want[:12]}) is missing or changed; pass --tokenizer"
    return None, "none recorded (prepared by another tool?); pass --tokenizer"


def inspect_dataset(prefix: str | Path, tokenizer: str = "", samples: int = 3, sample_chars: int = 300) -> str:
    """A report of ``prefix.bin/.idx``: documents, tokens, length statistics and histogram, samples.

    Samples are decoded with ``tokenizer`` (default: the one ``tessera prepare`` recorded, see
    :func:`find_tokenizer`); without one, token ids are shown.
    """
    prefix = str(prefix).removesuffix(".bin").removesuffix(".idx")
    indexed = open_indexed(prefix)
    lengths = indexed.sequence_lengths.astype(np.int64)
    tok, tok_line = find_tokenizer(prefix, tokenizer)
    lines = [
        f"dataset     {prefix}.bin/.idx ({np.dtype(indexed.index.dtype).name} tokens)",
        f"tokenizer   {tok_line}",
        f"documents   {len(lengths):,}",
        f"tokens      {int(lengths.sum()):,}",
        (
            f"doc length  min {lengths.min():,}  mean {lengths.mean():,.1f}  "
            f"median {int(np.median(lengths)):,}  max {lengths.max():,}"
        ),
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
        lines += [
            head + ("" if tok else ", token ids (no tokenizer; pass --tokenizer)"),
            "  " + body.replace("\n", "\n  "),
        ]
    return "\n".join(lines)


def realized_mix(loader: SequenceLoader, samples: int = 1000) -> str:
    """Each blended dataset's share of the next ``samples`` samples the loader hands out, beside its weight.

    Empty when the training split is a single dataset.
    """
    dataset = loader.dataset
    if not isinstance(dataset, BlendedSamples):
        return ""
    n = min(samples, len(dataset))
    counts = Counter(dataset.source_of(int(i)) for i in loader.sample_ids(loader.consumed, n))
    parts = [
        f"{part.prefix} {100 * counts.get(k, 0) / n:.1f}% (weight {100 * w:.1f}%)"
        for k, (part, w) in enumerate(zip(dataset.datasets, dataset.weights))
    ]
    return f"data mix of the next {n:,} samples: " + ", ".join(parts)
