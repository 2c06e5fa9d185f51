"""Blends of several prepared datasets by weight, and their train/valid/test splits.

A blend is written like Megatron's ``--data-path``: ``"PREFIX"`` or ``"W1 PREFIX1 W2 PREFIX2 ..."``.
The split is Megatron's ``"train,valid,test"`` weights over each dataset's documents (contiguous
ranges). Each component split is a megatron-core ``GPTDataset``; the blend interleaves them with
megatron-core's C++ ``build_blending_indices`` (greedy: after every prefix of the blend the
realized share of each dataset is as close to its weight as integers allow) and caches the
index on disk. megatron's own ``BlendedDataset`` is not used because its cache path requires an
initialized process group.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tessera.data.dataset import PackedSplit, gpt_config, index_cache_dir, open_indexed
from tessera.data.mixture import parse_weighted
from tessera.data.sources import DataError

SPLITS = ("train", "valid", "test")


def parse_blend(text: str) -> tuple[list[str], list[float] | None]:
    """``"a"`` -> (["a"], None); ``"0.7 a 0.3 b"`` -> (["a", "b"], [0.7, 0.3]) normalized; errors name data.blend."""
    return parse_weighted(text, "data.blend")


def parse_split(text: str) -> list[float]:
    """``"98,1,1"`` -> [0.98, 0.01, 0.01] (missing parts are 0); the train part must be positive."""
    try:
        parts = [float(x) for x in text.replace("/", ",").split(",")]
    except ValueError:
        raise DataError(
            f"data.split '{text}' must be up to three comma-separated numbers (train,valid,test), e.g. '98,1,1'"
        ) from None
    if not 1 <= len(parts) <= 3 or any(not math.isfinite(p) or p < 0 for p in parts) or parts[0] <= 0:
        raise DataError(
            f"data.split '{text}' must be up to three non-negative numbers (train,valid,test) with a positive train "
            "part, e.g. '98,1,1'"
        )
    parts += [0.0] * (3 - len(parts))
    return [p / sum(parts) for p in parts]


def split_ranges(n_docs: int, fractions: Sequence[float]) -> list[tuple[int, int] | None]:
    """Contiguous document ranges per split (Megatron's rounding); None where the weight is 0."""
    bounds = np.concatenate([[0.0], np.cumsum(fractions)])
    out: list[tuple[int, int] | None] = []
    for i, frac in enumerate(fractions):
        out.append((int(round(bounds[i] * n_docs)), int(round(bounds[i + 1] * n_docs))) if frac > 0 else None)
    return out


def _save_atomic(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        np.save(f, array)
    os.replace(tmp, path)


class MixedSamples:
    """Samples of several datasets: sample ``i`` is ``datasets[dataset_index[i]][sample_index[i]]``."""

    datasets: list[PackedSplit]
    dataset_index: np.ndarray
    sample_index: np.ndarray

    def __len__(self) -> int:
        return len(self.dataset_index)

    def source_of(self, i: int) -> int:
        """Which component dataset sample ``i`` comes from."""
        return int(self.dataset_index[i])

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.datasets[int(self.dataset_index[i])][int(self.sample_index[i])]


class BlendedSamples(MixedSamples):
    """Samples drawn from several datasets by weight; the interleaving is cached under ``cache``."""

    def __init__(self, datasets: Sequence[PackedSplit], weights: Sequence[float], size: int, cache: Path) -> None:
        self.datasets, self.weights, self.seq_len = list(datasets), list(weights), datasets[0].seq_len
        description = json.dumps(
            {"datasets": [d.unique_description for d in datasets], "weights": self.weights, "size": size}
        )
        key = hashlib.sha256(description.encode()).hexdigest()[:16]
        which_path, sample_path = cache / f"blend-{key}-dataset_index.npy", cache / f"blend-{key}-sample_index.npy"
        if which_path.is_file() and sample_path.is_file():
            self.dataset_index = np.load(which_path, mmap_mode="r")
            self.sample_index = np.load(sample_path, mmap_mode="r")
            return
        from megatron.core.datasets import helpers

        self.dataset_index = np.zeros(size, dtype=np.int16)
        self.sample_index = np.zeros(size, dtype=np.int64)
        helpers.build_blending_indices(
            self.dataset_index,
            self.sample_index,
            np.asarray(self.weights, dtype=np.float64),
            len(datasets),
            size,
            False,
        )
        cache.mkdir(parents=True, exist_ok=True)
        _save_atomic(sample_path, self.sample_index)
        _save_atomic(which_path, self.dataset_index)


def _natural_samples(indexed, doc_range: tuple[int, int], seq_len: int) -> int:
    tokens = int(indexed.sequence_lengths[doc_range[0] : doc_range[1]].astype(np.int64).sum())
    return max(0, (tokens - 1) // seq_len)


@dataclass
class Components:
    """The datasets of a blend, opened and checked, with their megatron configs and split fractions."""

    prefixes: list[str]
    indexed: list
    configs: list
    fractions: list[float]
    seq_len: int

    def ranges(self, split: int) -> list[tuple[int, int] | None]:
        """Each dataset's document range of split ``split`` (0 train, 1 valid, 2 test)."""
        return [sized_up_ranges(ix, self.fractions, self.seq_len)[0][split] for ix in self.indexed]

    def split(self, d: int, split: int, num_samples: int | None) -> PackedSplit:
        """Dataset ``d``'s split ``split`` as packed windows (``num_samples`` None = one epoch)."""
        ranges, notice = sized_up_ranges(self.indexed[d], self.fractions, self.seq_len)
        out = PackedSplit(self.prefixes[d], self.indexed[d], ranges[split], num_samples, SPLITS[split], self.configs[d])
        out.notice = notice.format(prefix=self.prefixes[d]) if split == 1 else ""
        return out


def _tokens(indexed, begin: int, end: int) -> int:
    return int(indexed.sequence_lengths[begin:end].astype(np.int64).sum())


def sized_up_ranges(indexed, fractions: Sequence[float], seq_len: int) -> tuple[list, str]:
    """Document ranges per split, the valid split grown (from the end of train) to hold one sequence.

    A short trial on a small folder of text would otherwise have a validation split of no
    sequence at all: the documents it takes from training are named in the returned notice
    (a format string with ``{prefix}``; "" when nothing moved).
    """
    ranges = split_ranges(len(indexed), fractions)
    train, valid = ranges[0], ranges[1]
    if train is None or valid is None or _tokens(indexed, *valid) > seq_len:
        return ranges, ""
    start = valid[0]
    while start > train[0] + 1 and _tokens(indexed, start, valid[1]) <= seq_len:
        start -= 1
    if _tokens(indexed, start, valid[1]) <= seq_len or _tokens(indexed, train[0], start) <= seq_len:
        return ranges, ""  # too little data to move: PackedSplit says so
    ranges[0], ranges[1] = (train[0], start), (start, valid[1])
    moved = valid[0] - start
    notice = (
        f"the valid split of '{{prefix}}' held fewer than one sequence of {seq_len + 1} tokens: it takes the last "
        f"{moved} training document(s) ({_tokens(indexed, start, valid[1]):,} tokens; set data.split to choose)"
    )
    return ranges, notice


def open_components(
    prefixes: list[str], split: str, seq_len: int, seed: int, eod: int, vocab_size: int, cache_dir: Path
) -> Components:
    """Open every dataset of a blend (errors name the file) and the megatron config of each."""
    fractions = parse_split(split)
    split_string = ",".join(f"{f:.6g}" for f in fractions)
    indexed = [open_indexed(p, vocab_size) for p in prefixes]
    # megatron keys its cached sample indices by split fractions, not documents: a split sized up
    # (sized_up_ranges) gets its own cache directory, so indices over other documents are never reused.
    caches = [
        index_cache_dir(cache_dir, p) / ("valid-sized-up" if sized_up_ranges(ix, fractions, seq_len)[1] else "")
        for p, ix in zip(prefixes, indexed)
    ]
    configs = [gpt_config(seq_len, seed, split_string, eod, vocab_size, path) for path in caches]
    return Components(list(prefixes), indexed, configs, fractions, seq_len)


def blended_split(parts: Components, weights: list[float] | None, split: int, cache_dir: Path):
    """Split ``split`` of the blend: one PackedSplit, or BlendedSamples as large as the components together."""
    ranges = parts.ranges(split)
    if ranges[0] is None:
        return None
    if weights is None:
        return parts.split(0, split, None)
    size = sum(_natural_samples(ix, r, parts.seq_len) for ix, r in zip(parts.indexed, ranges))
    datasets = [parts.split(d, split, math.ceil(w * size) + 1) for d, w in enumerate(weights)]
    return BlendedSamples(datasets, weights, size, cache_dir / "indices")


def build_splits(
    blend: str, split: str, seq_len: int, seed: int, eod: int, vocab_size: int, cache_dir: Path
) -> dict[str, PackedSplit | BlendedSamples | None]:
    """The train/valid/test datasets of ``blend`` (see the module doc); None for an empty split.

    One dataset is one epoch of its split. A blend has, per split, as many samples as its
    components have together, drawn by weight (components above their natural share repeat,
    reshuffled by megatron).
    """
    prefixes, weights = parse_blend(blend)
    parts = open_components(prefixes, split, seq_len, seed, eod, vocab_size, cache_dir)
    return {name: blended_split(parts, weights, s, cache_dir) for s, name in enumerate(SPLITS)}
