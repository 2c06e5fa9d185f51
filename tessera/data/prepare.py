"""Tokenize a corpus into a megatron-core indexed dataset (``.bin`` + ``.idx``), atomically."""

from __future__ import annotations

import hashlib
import os
import shutil
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tessera.data.sources import Document
from tessera.data.tokenizer import Tokenizer


def token_dtype(vocab_size: int) -> type[np.number]:
    """The smallest integer dtype that holds every token id of a vocabulary."""
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32


def _indexed_builder():
    # megatron-core imports are slow and noisy; load them only when tokens are written.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    return IndexedDatasetBuilder


def write_indexed_dataset(docs: Sequence[Document], tokenizer: Tokenizer, prefix: str | Path, batch: int = 256) -> int:
    """Write ``prefix.bin``/``prefix.idx`` with one EOS-terminated document per input document.

    Both files are written under a temporary name and renamed when complete, so an interrupted
    run never leaves a pair that looks finished. Returns the number of tokens written.
    """
    import torch  # megatron's builder takes tensors

    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    tmp = prefix.with_name(prefix.name + f".tmp{os.getpid()}")
    dtype = token_dtype(tokenizer.vocab_size)
    builder = _indexed_builder()(str(tmp) + ".bin", dtype=dtype)
    total = 0
    for start in range(0, len(docs), batch):
        for ids in tokenizer.encode_batch([d.text for d in docs[start : start + batch]]):
            ids.append(tokenizer.eos_id)
            builder.add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)])
            total += len(ids)
    builder.finalize(str(tmp) + ".idx")
    os.replace(str(tmp) + ".bin", str(prefix) + ".bin")
    os.replace(str(tmp) + ".idx", str(prefix) + ".idx")
    return total


def prepared_dataset(docs: Sequence[Document], corpus_hash: str, tokenizer: Tokenizer, cache_dir: str | Path) -> Path:
    """The indexed dataset prefix for this corpus and tokenizer, written once and then reused."""
    key = hashlib.sha256(corpus_hash.encode() + tokenizer.path.read_bytes()).hexdigest()[:16]
    prefix = Path(cache_dir) / "datasets" / key / "data"
    if not (Path(str(prefix) + ".bin").is_file() and Path(str(prefix) + ".idx").is_file()):
        write_indexed_dataset(docs, tokenizer, prefix)
    return prefix


def copy_indexed_dataset(prefix: str | Path, dest: str | Path) -> None:
    """Copy a ``.bin``/``.idx`` pair to a new prefix."""
    for ext in (".bin", ".idx"):
        shutil.copyfile(str(prefix) + ext, str(dest) + ext)
