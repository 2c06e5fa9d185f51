"""Prepared-data helpers: megatron-core indexed datasets of random documents."""

from __future__ import annotations

import warnings

import numpy as np
import torch

EOD = 3


def write_megatron_dataset(prefix, n_docs: int, low: int, high: int, seed: int = 0, dtype=np.uint16) -> None:
    """Documents of random tokens in [low, high) + EOD, written by megatron-core's own builder."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for _ in range(n_docs):
        doc = np.append(rng.integers(low, high, int(rng.integers(8, 120))), EOD)
        builder.add_document(torch.from_numpy(doc), [len(doc)])
    builder.finalize(f"{prefix}.idx")
