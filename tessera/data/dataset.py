"""Packed fixed-length training sequences over megatron-core indexed datasets."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

from tessera.data.sources import DataError


def open_indexed(prefix: str | Path):
    """Open ``prefix.bin/.idx`` with megatron-core's reader, or raise a DataError naming the file."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
        from megatron.core.datasets.indexed_dataset import IndexedDataset

    for ext in (".bin", ".idx"):
        if not Path(str(prefix) + ext).is_file():
            raise DataError(f"indexed dataset file '{prefix}{ext}' does not exist; run 'tessera prepare' or check data.source")
    try:
        return IndexedDataset(str(prefix))
    except (AssertionError, ValueError, OSError) as err:
        raise DataError(f"indexed dataset '{prefix}' is unreadable ({err}); re-run 'tessera prepare'") from None


def split_documents(n_docs: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Train and validation document ids: a seeded random ``val_fraction`` of documents is held out."""
    n_val = max(1, round(n_docs * val_fraction)) if val_fraction > 0 else 0
    if n_val >= n_docs:
        raise DataError(f"the corpus has only {n_docs} document(s); it needs more than one to hold out data.val_fraction={val_fraction}")
    order = np.random.default_rng(seed).permutation(n_docs)
    return np.sort(order[n_val:]), np.sort(order[:n_val])


class PackedSequences:
    """Documents concatenated end to end, cut into windows of ``seq_len + 1`` tokens.

    Window ``i`` covers tokens ``[i*seq_len, (i+1)*seq_len]`` of the concatenation (inputs and
    shifted labels share the overlapping token). Reads go through the memory-mapped dataset.
    """

    def __init__(self, indexed, doc_ids: np.ndarray, seq_len: int) -> None:
        self.indexed, self.doc_ids, self.seq_len = indexed, np.asarray(doc_ids, dtype=np.int64), seq_len
        lengths = indexed.sequence_lengths[self.doc_ids].astype(np.int64)
        self.doc_starts = np.concatenate([[0], np.cumsum(lengths)])
        self.total_tokens = int(self.doc_starts[-1])

    def __len__(self) -> int:
        return max(0, (self.total_tokens - 1) // self.seq_len)

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < len(self):
            raise IndexError(i)
        start, end = i * self.seq_len, i * self.seq_len + self.seq_len + 1
        first = int(np.searchsorted(self.doc_starts, start, side="right")) - 1
        pieces = []
        pos, d = start, first
        while pos < end:
            offset = pos - int(self.doc_starts[d])
            take = min(end - pos, int(self.doc_starts[d + 1]) - pos)
            pieces.append(self.indexed.get(int(self.doc_ids[d]), offset=offset, length=take))
            pos += take
            d += 1
        return np.concatenate(pieces).astype(np.int64)
