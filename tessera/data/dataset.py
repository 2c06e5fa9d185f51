"""Packed fixed-length sequences over megatron-core indexed datasets, through megatron's GPTDataset.

megatron-core's ``GPTDataset`` owns the sample layout: documents of one split are shuffled
(seeded), concatenated across boundaries and cut into windows of ``seq_len + 1`` tokens; its
document, sample and shuffle indices are built by megatron's C++ helpers and cached on disk, so
every process and every rerun sees the same samples. tessera checks each file at the door
(:func:`open_indexed`) and reads windows as plain token arrays.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import warnings
from collections import OrderedDict
from pathlib import Path

import numpy as np

from tessera.data.prepare import indexed_dataset_classes
from tessera.data.sources import DataError

_IDX_HEADER_BYTES = 34  # magic (9) + version (8) + dtype code (1) + sequence count (8) + document count (8)
_IDX_MAGIC = b"MMIDIDX\x00\x00"
_NPY_MAGIC = b"\x93NUMPY"
_DTYPE_CODES = (1, 2, 3, 4, 5, 8)  # megatron's integer DType codes (uint8, int8, int16, int32, int64, uint16)


def _megatron_gpt():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
        from megatron.core.datasets import gpt_dataset

    for name in (
        "megatron.core.datasets",
        "megatron.core.datasets.gpt_dataset",
        "megatron.core.datasets.indexed_dataset",
    ):
        logging.getLogger(name).setLevel(logging.WARNING)
    return gpt_dataset


def _check_idx(prefix: str) -> None:
    """The .idx header and size, checked before megatron's reader (whose failures print from ``__del__``)."""
    path = Path(f"{prefix}.idx")
    with open(path, "rb") as f:
        header = f.read(_IDX_HEADER_BYTES)
    if len(header) < _IDX_HEADER_BYTES or header[:9] != _IDX_MAGIC:
        raise DataError(
            f"indexed dataset '{path}' is unreadable (bad header: not a megatron .idx file); re-run 'tessera prepare'"
        )
    version, code, sequences, documents = struct.unpack("<QBQQ", header[9:])
    if version != 1 or code not in _DTYPE_CODES:
        raise DataError(
            f"indexed dataset '{path}' is unreadable (bad header: version {version}, dtype code {code}); re-run "
            "'tessera prepare'"
        )
    expected = _IDX_HEADER_BYTES + sequences * 12 + documents * 8
    if path.stat().st_size != expected:
        raise DataError(
            f"indexed dataset '{path}' is truncated or corrupted ({path.stat().st_size} bytes, its header implies "
            f"{expected}); re-run 'tessera prepare'"
        )
    if sequences == 0:
        raise DataError(f"indexed dataset '{path}' holds no documents; prepare it from a non-empty corpus")


def _check_bin(prefix: str, indexed) -> None:
    """The .idx must describe exactly the bytes of the .bin (catches truncation and corruption)."""
    lengths = indexed.sequence_lengths.astype(np.int64)
    itemsize = np.dtype(indexed.index.dtype).itemsize
    idx_path, bin_path = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    if (lengths < 0).any() or not np.array_equal(
        indexed.index.sequence_pointers, np.concatenate([[0], np.cumsum(lengths)[:-1]]) * itemsize
    ):
        raise DataError(
            f"indexed dataset '{idx_path}' is corrupted (sequence pointers do not match lengths); re-run 'tessera "
            "prepare'"
        )
    expected = int(lengths.sum()) * itemsize
    if bin_path.stat().st_size != expected:
        raise DataError(
            f"indexed dataset file '{bin_path}' is truncated or corrupted ({bin_path.stat().st_size} bytes, "
            f"'{idx_path.name}' describes {expected}); re-run 'tessera prepare'"
        )


def open_indexed(prefix: str | Path, vocab_size: int = 0):
    """Open ``prefix.bin/.idx`` with megatron-core's reader after checking it; errors name the file.

    ``vocab_size`` (when given) must fit the stored token dtype.
    """
    prefix = str(prefix)
    for ext in (".bin", ".idx"):
        if not Path(prefix + ext).is_file():
            raise DataError(
                f"indexed dataset file '{prefix}{ext}' does not exist; run 'tessera prepare' or check data.blend"
            )
    _check_idx(prefix)
    try:
        indexed = indexed_dataset_classes()[0](prefix)
    except (ValueError, OSError) as err:  # e.g. an empty .bin cannot be memory-mapped
        raise DataError(f"indexed dataset '{prefix}.bin' is unreadable ({err}); re-run 'tessera prepare'") from None
    _check_bin(prefix, indexed)
    dtype = np.dtype(indexed.index.dtype)
    if vocab_size and np.iinfo(dtype).max + 1 < vocab_size:
        raise DataError(
            f"indexed dataset '{prefix}.bin' stores tokens as {dtype.name} (ids < {np.iinfo(dtype).max + 1}) but the "
            f"tokenizer has {vocab_size} tokens; re-run 'tessera prepare' with this tokenizer"
        )
    return indexed


class EodTokenizer:
    """The part of a tokenizer megatron's GPTDataset reads: the EOD id and the vocabulary size."""

    def __init__(self, eod: int, vocab_size: int) -> None:
        self.eod, self.vocab_size = eod, vocab_size
        self.unique_identifiers = OrderedDict(eod=eod, vocab_size=vocab_size)


def gpt_config(seq_len: int, seed: int, split: str, eod: int, vocab_size: int, cache: Path):
    """A megatron ``GPTDatasetConfig`` for plain token windows (tessera builds masks itself)."""
    gpt_dataset = _megatron_gpt()
    return gpt_dataset.GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_len,
        blend=([], None),
        split=split,
        path_to_cache=str(cache),
        tokenizer=EodTokenizer(eod, vocab_size),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )


def check_index_cache(path: Path) -> None:
    """Refuse cached sample indices that are not plain NumPy files.

    megatron-core loads its cached indices with ``numpy.load(allow_pickle=True)``, which unpickles
    (runs) anything that is not an ``.npy`` array; a cache directory shared or shipped by someone
    else must not be able to run code. mmap loading already refuses object arrays inside ``.npy``.
    """
    for file in sorted(path.glob("*.npy")) if path.is_dir() else []:
        with open(file, "rb") as f:
            if f.read(len(_NPY_MAGIC)) != _NPY_MAGIC:
                raise DataError(
                    f"cached index '{file}' is not a NumPy array file and tessera will not unpickle it; delete it (it "
                    "is rebuilt) or point data.cache_dir at a directory only you write to"
                )


def index_cache_dir(cache_dir: Path, prefix: str) -> Path:
    """Where the sample indices of ``prefix`` live: keyed by its path, size and modification time."""
    stats = [(p.stat().st_size, p.stat().st_mtime_ns) for p in (Path(f"{prefix}.bin"), Path(f"{prefix}.idx"))]
    key = hashlib.sha256(repr((str(Path(prefix).resolve()), stats)).encode()).hexdigest()[:16]
    return cache_dir / "indices" / key


class PackedSplit:
    """One split of one indexed dataset as packed windows of ``seq_len + 1`` tokens (megatron GPTDataset)."""

    def __init__(
        self, prefix: str, indexed, doc_range: tuple[int, int], num_samples: int | None, split_name: str, config
    ) -> None:
        gpt_dataset = _megatron_gpt()
        from megatron.core.datasets.utils import Split

        begin, end = doc_range
        tokens = int(indexed.sequence_lengths[begin:end].astype(np.int64).sum())
        if tokens < config.sequence_length + 1:
            raise DataError(
                f"the {split_name} split of '{prefix}' (documents {begin}..{end}) holds {tokens} tokens, fewer than "
                "one sequence of "
                f"{config.sequence_length + 1}; change data.split / data.val_fraction, shorten train.seq_len or use "
                "more data"
            )
        self.prefix, self.seq_len, self.tokens = prefix, config.sequence_length, tokens
        self.notice = ""  # set when the split was sized up to hold one sequence (blend.sized_up_ranges)
        self.vocab_size = config.tokenizer.vocab_size
        indices = np.arange(begin, end, dtype=np.int32)
        check_index_cache(Path(config.path_to_cache))
        # Under a process group megatron writes the index cache on rank 0 only: build there first (the trainer does).
        self.gpt = gpt_dataset.GPTDataset(indexed, prefix, indices, num_samples, Split[split_name], config)

    @property
    def unique_description(self) -> str:
        """megatron's description of this dataset (its cache identity)."""
        return self.gpt.unique_description

    def __len__(self) -> int:
        return len(self.gpt)

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < len(self):
            raise IndexError(i)
        # The raw window (seq_len + 1 tokens); GPTDataset.__getitem__ would add masks tessera builds per batch.
        tokens, _ = self.gpt._query_document_sample_shuffle_indices(int(i))
        if tokens.size and int(tokens.max()) >= self.vocab_size:  # one max per window: cheap, and every id is seen
            raise DataError(
                f"indexed dataset '{self.prefix}.bin' holds token id {int(tokens.max())} but the tokenizer has "
                f"{self.vocab_size} tokens; it was prepared with another tokenizer: set data.tokenizer to that one or "
                "re-run 'tessera prepare' with this one"
            )
        return tokens
