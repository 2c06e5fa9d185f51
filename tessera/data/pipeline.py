"""From config to batches: corpus or prepared blend -> tokenizer -> packed splits -> loaders.

``data.blend`` names datasets already written by ``tessera prepare`` (or by Megatron), and
``data.blend_schedule`` changes their weights by step ranges (:mod:`tessera.data.schedule`).
Without either, ``data.source`` is read, a tokenizer trained on it ("default" or "bpe") and the
corpus prepared into the cache, then used as a one-dataset blend: all ways share the same
splits and loader.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from tessera.config import JobConfig
from tessera.data.batch import Collate
from tessera.data.blend import BlendedSamples, build_splits
from tessera.data.dataset import PackedSplit
from tessera.data.loader import SequenceLoader
from tessera.data.mixture import parse_blend_schedule
from tessera.data.prepare import prepared_dataset
from tessera.data.schedule import ScheduledBlend, build_scheduled_splits, format_phase_report
from tessera.data.sources import DataError, Document, load_corpus
from tessera.data.tokenizer import Tokenizer, train_or_load_tokenizer


def cache_dir(configured: str = "") -> Path:
    """Where tokenizers and prepared datasets are cached: data.cache_dir, $TESSERA_CACHE, ~/.cache/tessera."""
    path = Path(configured or os.environ.get("TESSERA_CACHE") or Path.home() / ".cache" / "tessera")
    if path.exists() and not path.is_dir():
        where = "data.cache_dir" if configured else "$TESSERA_CACHE" if os.environ.get("TESSERA_CACHE") else "the cache"
        raise DataError(f"{where} '{path}' is a file, not a directory; point {where} at a directory")
    return path


def build_tokenizer(
    config: JobConfig, docs: list[Document], corpus_hash: str, spec: str = ""
) -> tuple[Tokenizer, bool]:
    """The tokenizer of ``spec`` (default ``data.tokenizer``; "default"/"bpe" train one on the corpus); and
    whether it was cached."""
    d, vocab = config.data, config.model.vocab_size - config.model.sentinel_tokens  # top ids: [MASK] / T5 sentinels
    tokenizer, cached = train_or_load_tokenizer(
        spec or d.tokenizer, vocab, docs, corpus_hash, d.tokenizer_chars, cache_dir(d.cache_dir)
    )
    check_vocab(tokenizer, config)
    return tokenizer, cached


def check_vocab(tokenizer: Tokenizer, config: JobConfig) -> None:
    """The model's embedding table must cover the tokenizer (ids above it are reserved for sentinels)."""
    m = config.model
    if tokenizer.vocab_size > m.vocab_size - m.sentinel_tokens:
        reserved = f" minus model.sentinel_tokens={m.sentinel_tokens}" if m.sentinel_tokens else ""
        raise DataError(
            f"tokenizer '{tokenizer.source}' has {tokenizer.vocab_size} tokens but model.vocab_size is "
            f"{m.vocab_size}{reserved}; set model.vocab_size >= {tokenizer.vocab_size + m.sentinel_tokens}"
        )


def split_string(config: JobConfig) -> str:
    """``data.split``, or "train,valid,0" derived from ``data.val_fraction`` when it is empty."""
    d = config.data
    return d.split or f"{1 - d.val_fraction:.6g},{d.val_fraction:.6g},0"


Split = PackedSplit | BlendedSamples | ScheduledBlend


@dataclass
class DataBundle:
    """Everything the trainer reads: tokenizer, training loader, held-out splits, batch collation."""

    tokenizer: Tokenizer
    tokenizer_cached: bool
    train: SequenceLoader
    val: Split | None
    collate: Collate
    test: Split | None = None

    @property
    def notice(self) -> str:
        """A line about how the validation split was sized (see blend.sized_up_ranges), or ""."""
        parts = getattr(self.val, "datasets", [self.val])
        return "; ".join(n for n in (getattr(part, "notice", "") for part in parts) if n)

    def log_blend_phase(self, step: int, run_dir: Path | None = None) -> str:
        """Under ``data.blend_schedule``, after the last step of a phase: its realized mix as a console line,
        also appended to ``run_dir/blend_phases.jsonl`` when given (rank 0); else ""."""
        schedule = self.train.dataset
        report = schedule.phase_report(step) if isinstance(schedule, ScheduledBlend) else None
        if report is None:
            return ""
        if run_dir is not None:
            path = Path(run_dir) / BLEND_PHASES
            # A resumed run may finish a phase again: keep one record per phase.
            kept = [r for r in read_jsonl(path) if r["phase"] != report["phase"]]
            path.write_text("".join(json.dumps(r) + "\n" for r in sorted(kept + [report], key=lambda r: r["phase"])))
        return format_phase_report(report, len(schedule.phases))


BLEND_PHASES = "blend_phases.jsonl"


def read_jsonl(path: Path) -> list[dict]:
    """The JSON records of a .jsonl file (none when it does not exist)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def resolve_blend(config: JobConfig) -> tuple[str, Tokenizer, bool]:
    """The blend string to train on and its tokenizer: ``data.blend``, or the prepared ``data.source``."""
    d = config.data
    if d.blend or d.blend_schedule:
        tokenizer = Tokenizer(d.tokenizer)
        check_vocab(tokenizer, config)
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
    common = (split_string(config), t.seq_len, t.seed, tokenizer.eos_id, tokenizer.vocab_size, cache_dir(d.cache_dir))
    if d.blend_schedule:
        phases = parse_blend_schedule(d.blend_schedule, t.steps)
        splits = build_scheduled_splits(phases, *common, samples_per_step=t.batch_size * t.grad_accum)
    else:
        splits = build_splits(blend, *common)
    collate = Collate(tokenizer.eos_id, d.document_mask, d.mask_eod_loss)
    # train.batch_size is global: each data-parallel rank loads its 1/dp_size slice.
    # Under pipeline parallelism, micro-batch j of every rank together is the global batch's j-th part.
    chunks = (config.parallel.microbatches or config.parallel.pp) if config.parallel.pp > 1 else 1
    loader = SequenceLoader(splits["train"], per_rank, t.seed, dp_rank, dp_size, collate, d.prefetch, chunks)
    return DataBundle(tokenizer, cached, loader, splits["valid"], collate, splits["test"])
