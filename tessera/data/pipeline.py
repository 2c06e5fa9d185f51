"""From config to batches: corpus -> tokenizer -> indexed dataset -> packed train/val loaders."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tessera.config import JobConfig
from tessera.data.dataset import PackedSequences, open_indexed, split_documents
from tessera.data.loader import SequenceLoader
from tessera.data.prepare import prepared_dataset
from tessera.data.sources import DataError, Document, load_corpus
from tessera.data.tokenizer import Tokenizer, train_tokenizer


def cache_dir(configured: str = "") -> Path:
    """Where tokenizers and prepared datasets are cached: data.cache_dir, $TESSERA_CACHE, ~/.cache/tessera."""
    return Path(configured or os.environ.get("TESSERA_CACHE") or Path.home() / ".cache" / "tessera")


def _tokenizer_sample(docs: list[Document], max_chars: int) -> list[Document]:
    sample, total = [], 0
    for doc in docs:
        if total >= max_chars:
            break
        sample.append(Document(doc.name, doc.text[: max_chars - total]))
        total += len(sample[-1].text)
    return sample


def build_tokenizer(config: JobConfig, docs: list[Document], corpus_hash: str) -> tuple[Tokenizer, bool]:
    """The tokenizer of ``data.tokenizer`` (trained on the corpus for "default"); and whether it was cached."""
    vocab = config.model.vocab_size
    if config.data.tokenizer == "default":
        key = f"{corpus_hash}:{config.data.tokenizer_chars}"
        path, cached = train_tokenizer(_tokenizer_sample(docs, config.data.tokenizer_chars), key, vocab, cache_dir(config.data.cache_dir))
        tokenizer = Tokenizer(path)
    else:
        tokenizer, cached = Tokenizer(config.data.tokenizer), True
    if tokenizer.vocab_size > vocab:
        raise DataError(f"tokenizer '{tokenizer.path}' has {tokenizer.vocab_size} tokens but model.vocab_size is {vocab}; set model.vocab_size >= {tokenizer.vocab_size}")
    return tokenizer, cached


@dataclass
class DataBundle:
    """Everything the trainer reads: tokenizer, training loader, validation sequences."""

    tokenizer: Tokenizer
    tokenizer_cached: bool
    train: SequenceLoader
    val: PackedSequences


def build_data(config: JobConfig, dp_rank: int = 0, dp_size: int = 1) -> DataBundle:
    """Prepare (or reuse from the cache) the tokenized corpus and return the loaders."""
    d, t = config.data, config.train
    docs, corpus_hash = load_corpus(d.source, d.max_chars)
    tokenizer, cached = build_tokenizer(config, docs, corpus_hash)
    prefix = prepared_dataset(docs, corpus_hash, tokenizer, cache_dir(d.cache_dir))
    indexed = open_indexed(prefix)
    train_ids, val_ids = split_documents(len(indexed), d.val_fraction, t.seed)
    train = PackedSequences(indexed, train_ids, t.seq_len)
    val = PackedSequences(indexed, val_ids, t.seq_len)
    if d.val_fraction > 0 and len(val) == 0:
        raise DataError(f"the held-out documents hold fewer than {t.seq_len + 1} tokens; raise data.val_fraction or use more data")
    loader = SequenceLoader(train, t.batch_size, t.seed, dp_rank, dp_size)
    return DataBundle(tokenizer, cached, loader, val)
