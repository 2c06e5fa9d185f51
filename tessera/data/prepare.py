"""Tokenize a corpus in parallel into a megatron-core indexed dataset (``.bin`` + ``.idx``), atomically.

Every document becomes one sequence ending in EOS. Tokens are stored in the smallest dtype that
holds the vocabulary (uint16 up to 65,536 tokens, else int32), as megatron-core does. Both files
are written under temporary names and renamed only when complete (``.idx`` last), so an
interrupted run never leaves a pair that looks finished.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import sys
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from itertools import chain, islice
from pathlib import Path

import numpy as np

from tessera.data.sources import (
    DataError,
    Document,
    corpus_hash,
    iter_documents,
    no_documents,
)
from tessera.data.tokenizer import Tokenizer, train_or_load_tokenizer

CHUNK_DOCS = 256  # documents per tokenization task


def token_dtype(vocab_size: int) -> type[np.number]:
    """The smallest integer dtype that holds every token id of a vocabulary."""
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32


def indexed_dataset_classes():
    """megatron-core's ``(IndexedDataset, IndexedDatasetBuilder)``, imported quietly on first use."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
        from megatron.core.datasets.indexed_dataset import (
            IndexedDataset,
            IndexedDatasetBuilder,
        )

    return IndexedDataset, IndexedDatasetBuilder


@dataclass
class PrepareSummary:
    """What one ``prepare`` run wrote."""

    prefix: Path
    documents: int
    tokens: int
    seconds: float
    dtype: str
    skipped: tuple[str, ...] = ()  # binary files of the source folder left out

    @property
    def tokens_per_s(self) -> float:
        """Tokenization and write throughput."""
        return self.tokens / max(self.seconds, 1e-9)

    def line(self) -> str:
        """One-line human summary."""
        return (
            f"{self.documents:,} documents, {self.tokens:,} tokens ({self.dtype}) in {self.seconds:.1f}s = "
            f"{self.tokens_per_s:,.0f} tokens/s -> {self.prefix}.bin/.idx"
        ) + (f"; skipped {len(self.skipped)} binary file(s), e.g. {self.skipped[0]}" if self.skipped else "")


_WORKER: dict[str, Tokenizer] = {}


def _init_worker(tokenizer_path: str) -> None:
    # A forked worker inherits the caller's Python SIGTERM handler (a trainer's preemption guard), which
    # would keep Pool.terminate from ending it; it runs in the main process only, so restore the default.
    if multiprocessing.parent_process() is not None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _WORKER["tok"] = Tokenizer(tokenizer_path)


def _encode_chunk(texts: list[str], threads: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """All tokens of ``texts`` (each followed by EOS) as one array, and the per-document lengths."""
    tok = _WORKER["tok"]
    ids = tok.encode_batch(texts, threads=threads)
    lengths = np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids))
    flat = np.empty(int(lengths.sum()), dtype=np.int64)
    ends = np.cumsum(lengths)
    for row, end, n in zip(ids, ends, lengths):
        flat[end - n : end - 1] = row
        flat[end - 1] = tok.eos_id
    return flat, lengths


def _chunks(texts: Iterable[str]) -> Iterator[list[str]]:
    it = iter(texts)
    while chunk := list(islice(it, CHUNK_DOCS)):
        yield chunk


def _encoded(texts: Iterable[str], tokenizer_path: Path, num_proc: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Encoded chunks in input order; ``num_proc`` > 1 uses that many worker processes."""
    if num_proc <= 1:
        _init_worker(str(tokenizer_path))
        for chunk in _chunks(texts):
            yield _encode_chunk(chunk)
        return
    # fork: workers inherit the loaded modules and never re-run the caller's __main__. HF tokenizers
    # run one thread per worker (the processes are the parallelism), set before the fork they inherit.
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        pool = multiprocessing.get_context("fork").Pool(num_proc, _init_worker, (str(tokenizer_path),))
    finally:
        if previous is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous
    with pool:
        yield from pool.imap(_encode_chunk, _chunks(texts), chunksize=1)


def _remove(*paths: Path) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


def write_indexed_dataset(
    texts: Iterable[str], tokenizer: Tokenizer, prefix: str | Path, num_proc: int = 1, progress: bool = False
) -> PrepareSummary:
    """Tokenize ``texts`` (one document each) into ``prefix.bin``/``prefix.idx``; see the module doc."""
    import torch  # megatron's builder takes tensors
    from tqdm import tqdm

    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    tmp_bin, tmp_idx = (prefix.with_name(f"{prefix.name}.tmp{os.getpid()}{ext}") for ext in (".bin", ".idx"))
    final_bin, final_idx = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
    dtype = token_dtype(tokenizer.vocab_size)
    started = time.perf_counter()
    docs = tokens = 0
    bar = tqdm(desc=f"prepare {prefix.name}", unit=" docs", disable=not progress, file=sys.stderr, dynamic_ncols=True)
    try:
        builder = indexed_dataset_classes()[1](str(tmp_bin), dtype=dtype)
        for flat, lengths in _encoded(texts, tokenizer.source, num_proc):
            for piece in np.split(flat, np.cumsum(lengths)[:-1]):
                builder.add_document(torch.from_numpy(piece), [len(piece)])
            docs, tokens = docs + len(lengths), tokens + len(flat)
            bar.update(len(lengths))
            bar.set_postfix(tokens=f"{tokens:,}", refresh=False)
        if docs == 0:
            raise DataError(f"no non-empty documents to write to '{prefix}'; check the source and its text field")
        builder.finalize(str(tmp_idx))
        _remove(final_idx)  # never leave a new .bin next to an old .idx
        os.replace(tmp_bin, final_bin)
        os.replace(tmp_idx, final_idx)
    finally:
        bar.close()
        _remove(tmp_bin, tmp_idx)
    return PrepareSummary(prefix, docs, tokens, time.perf_counter() - started, np.dtype(dtype).name)


def prepare_source(
    source: str,
    prefix: str | Path,
    tokenizer: Tokenizer,
    text_field: str = "text",
    max_chars: int = 0,
    num_proc: int = 1,
    progress: bool = False,
) -> PrepareSummary:
    """Stream the documents of ``source`` (see :mod:`tessera.data.sources`) into an indexed dataset."""
    skipped: list[str] = []
    docs = iter_documents(source, max_chars, text_field, skipped)
    first = next(docs, None)
    if first is None:
        raise no_documents(source, text_field)
    texts = (doc.text for doc in chain([first], docs))
    summary = write_indexed_dataset(texts, tokenizer, prefix, num_proc, progress)
    return replace(summary, skipped=tuple(skipped))


def tokenizer_sidecar(prefix: str | Path) -> Path:
    """Where ``tessera prepare`` keeps a copy of the tokenizer it used for ``prefix``."""
    return Path(f"{prefix}.tokenizer.model")


def tokenizer_record(prefix: str | Path) -> Path:
    """Where ``tessera prepare`` records which tokenizer it used (path, sha256, vocabulary size)."""
    return Path(f"{prefix}.tokenizer.json")


def file_sha256(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def record_tokenizer(prefix: str | Path, tokenizer: Tokenizer) -> Tokenizer:
    """Keep the tokenizer beside the dataset (``PREFIX.tokenizer.model``) and record where it came from.

    Returns the kept copy, which is what the dataset was tokenized with.
    """
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    kept = tokenizer_sidecar(prefix)
    if not (kept.is_file() and kept.samefile(tokenizer.path)):
        shutil.copyfile(tokenizer.path, kept)
    record = {"path": str(tokenizer.path.resolve()), "sha256": file_sha256(kept), "vocab_size": tokenizer.vocab_size}
    record["copy"] = kept.name
    tokenizer_record(prefix).write_text(json.dumps(record, indent=1) + "\n")
    # An HF tokenizer's special tokens live in the tokenizer_config.json beside the original, not in the copy.
    return Tokenizer(kept) if tokenizer.kind == "sentencepiece" else tokenizer


def prepare_corpus(
    source: str,
    prefix: str | Path,
    tokenizer: str = "default",
    vocab_size: int = 2048,
    text_field: str = "text",
    max_chars: int = 0,
    tokenizer_chars: int = 10_000_000,
    num_proc: int = 1,
    cache_dir: str | Path = Path.home() / ".cache" / "tessera",
    progress: bool = False,
) -> tuple[PrepareSummary, Tokenizer]:
    """``tessera prepare``: tokenize ``source`` into ``prefix.bin/.idx``.

    ``tokenizer`` "default" trains a ``vocab_size`` SentencePiece model on the first
    ``tokenizer_chars`` characters of the source (cached in ``cache_dir``); otherwise it is the
    path of an existing model. Either way a copy is kept at ``prefix.tokenizer.model`` and its
    origin and hash in ``prefix.tokenizer.json``, so ``tessera data inspect`` decodes without being told.
    """
    if next(iter_documents(source, 1, text_field), None) is None:  # before anything is written next to prefix
        raise no_documents(source, text_field)
    if tokenizer == "default":
        sample = list(iter_documents(source, tokenizer_chars, text_field))
        if not sample:
            raise no_documents(source, text_field)
        tok, _ = train_or_load_tokenizer("default", vocab_size, sample, corpus_hash(sample), tokenizer_chars, cache_dir)
    else:
        tok = Tokenizer(tokenizer)
    tok = record_tokenizer(prefix, tok)
    return prepare_source(source, prefix, tok, text_field, max_chars, num_proc, progress), tok


def prepared_dataset(
    docs: list[Document], content_hash: str, tokenizer: Tokenizer, cache_dir: str | Path, num_proc: int = 1
) -> Path:
    """The indexed dataset prefix for this corpus and tokenizer, written once and then reused."""
    key = hashlib.sha256((content_hash + tokenizer.fingerprint).encode()).hexdigest()[:16]
    prefix = Path(cache_dir) / "datasets" / key / "data"
    if not (Path(f"{prefix}.bin").is_file() and Path(f"{prefix}.idx").is_file()):
        write_indexed_dataset((d.text for d in docs), tokenizer, prefix, num_proc)
    return prefix
