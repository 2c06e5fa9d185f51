"""From config to batches: corpus or prepared blend -> tokenizer -> packed splits -> loaders.

``data.blend`` names datasets already written by ``tessera prepare`` (or by Megatron). Without
it, ``data.source`` is read, a tokenizer trained on it ("default") and the corpus prepared into
the cache, then used as a one-dataset blend: both ways share the same splits and loader.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tessera.config import ConfigError, JobConfig
from tessera.data.batch import Collate
from tessera.data.blend import BlendedSamples, build_splits
from tessera.data.dataset import PackedSplit
from tessera.data.loader import SequenceLoader
from tessera.data.prepare import prepared_dataset
from tessera.data.sources import DataError, Document, load_corpus
from tessera.data.tokenizer import Tokenizer, train_or_load_tokenizer


def cache_dir(configured: str = "") -> Path:
    """Where tokenizers and prepared datasets are cached: data.cache_dir, $TESSERA_CACHE, ~/.cache/tessera."""
    path = Path(configured or os.environ.get("TESSERA_CACHE") or Path.home() / ".cache" / "tessera")
    if path.exists() and not path.is_dir():
        where = "data.cache_dir" if configured else "$TESSERA_CACHE" if os.environ.get("TESSERA_CACHE") else "the cache"
        raise DataError(f"{where} '{path}' is a file, not a directory; point {where} at a directory")
    return path


def build_tokenizer(config: JobConfig, docs: list[Document], corpus_hash: str) -> tuple[Tokenizer, bool]:
    """The tokenizer of ``data.tokenizer`` (trained on the corpus for "default"); and whether it was cached."""
    d, vocab = config.data, config.model.vocab_size - config.model.sentinel_tokens  # top ids: [MASK] / T5 sentinels
    tokenizer, cached = train_or_load_tokenizer(
        d.tokenizer, vocab, docs, corpus_hash, d.tokenizer_chars, cache_dir(d.cache_dir)
    )
    check_vocab(tokenizer, vocab)
    return tokenizer, cached


def check_vocab(tokenizer: Tokenizer, vocab_size: int) -> None:
    """The model's embedding table must cover the tokenizer."""
    if tokenizer.vocab_size > vocab_size:
        raise DataError(
            f"tokenizer '{tokenizer.path}' has {tokenizer.vocab_size} tokens but model.vocab_size is {vocab_size}; "
            f"set model.vocab_size >= {tokenizer.vocab_size}"
        )


def split_string(config: JobConfig) -> str:
    """``data.split``, or "train,valid,0" derived from ``data.val_fraction`` when it is empty."""
    d = config.data
    return d.split or f"{1 - d.val_fraction:.6g},{d.val_fraction:.6g},0"


Split = PackedSplit | BlendedSamples


@dataclass
class DataBundle:
    """Everything the trainer reads: tokenizer, training loader, held-out splits, batch collation."""

    tokenizer: Tokenizer
    tokenizer_cached: bool
    train: SequenceLoader
    val: Split | None
    collate: Collate
    test: Split | None = None


def resolve_blend(config: JobConfig) -> tuple[str, Tokenizer, bool]:
    """The blend string to train on and its tokenizer: ``data.blend``, or the prepared ``data.source``."""
    d = config.data
    if d.blend:
        tokenizer = Tokenizer(d.tokenizer)
        check_vocab(tokenizer, config.model.vocab_size - config.model.sentinel_tokens)
        return d.blend, tokenizer, True
    docs, corpus_hash = load_corpus(d.source, d.max_chars, d.text_field)
    tokenizer, cached = build_tokenizer(config, docs, corpus_hash)
    prefix = prepared_dataset(docs, corpus_hash, tokenizer, cache_dir(d.cache_dir), d.num_proc)
    return str(prefix), tokenizer, cached


def build_data(config: JobConfig, dp_rank: int = 0, dp_size: int = 1) -> DataBundle:
    """Prepare (or reuse from the cache) the data of ``config`` and return this rank's loaders.

    ``train.batch_size`` is the global batch: each of the ``dp_size`` ranks loads its share.
    """
    d, t = config.data, config.train
    per_rank = t.batch_size // dp_size  # divisibility is checked by tessera.layout.check_layout
    blend, tokenizer, cached = resolve_blend(config)
    splits = build_splits(
        blend, split_string(config), t.seq_len, t.seed, tokenizer.eos_id, tokenizer.vocab_size, cache_dir(d.cache_dir)
    )
    collate = Collate(tokenizer.eos_id, d.document_mask, d.mask_eod_loss)
    # train.batch_size is global: each data-parallel rank loads its 1/dp_size slice.
    loader = SequenceLoader(splits["train"], per_rank, t.seed, dp_rank, dp_size, collate, d.prefetch)
    return DataBundle(tokenizer, cached, loader, splits["valid"], collate, splits["test"])
