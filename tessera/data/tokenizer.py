"""SentencePiece BPE tokenizers: train (cached by content hash), load, encode, decode."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import sentencepiece as spm

from tessera.data.sources import DataError, Document

# SentencePiece reads one sentence per line, so newlines are replaced by this symbol (one token).
NEWLINE = "\u21b5"
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
MIN_TRAINED_VOCAB = 260  # 4 special ids + 256 byte-fallback pieces
_TRAIN_OPTIONS = dict(
    model_type="bpe",
    byte_fallback=True,
    pad_id=PAD_ID,
    unk_id=UNK_ID,
    bos_id=BOS_ID,
    eos_id=EOS_ID,
    user_defined_symbols=[NEWLINE, "    "],
    normalization_rule_name="identity",
    remove_extra_whitespaces=False,
    allow_whitespace_only_pieces=True,
    split_digits=True,
    max_sentence_length=8192,
    input_sentence_size=0,
    shuffle_input_sentence=False,
    character_coverage=0.9995,
)


class Tokenizer:
    """A loaded SentencePiece model that keeps newlines (see ``NEWLINE``)."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        if not path.is_file():
            raise DataError(
                f"tokenizer '{path}' does not exist; train one with 'tessera tokenizer train' or set data.tokenizer"
            )
        self.path = path
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.LoadFromSerializedProto(path.read_bytes())
        except RuntimeError as err:
            raise DataError(f"tokenizer '{path}' is not a SentencePiece model: {err}") from None
        self.vocab_size = self.sp.get_piece_size()
        self.bos_id, self.eos_id, self.pad_id = self.sp.bos_id(), self.sp.eos_id(), self.sp.pad_id()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added)."""
        return self.sp.encode(text.replace("\n", NEWLINE))

    def encode_batch(self, texts: Sequence[str], threads: int = 0) -> list[list[int]]:
        """Token ids of many texts at once on ``threads`` SentencePiece threads (0 = all cores)."""
        return self.sp.encode([t.replace("\n", NEWLINE) for t in texts], num_threads=threads or os.cpu_count() or 1)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; special tokens are dropped."""
        return self.sp.decode([int(i) for i in ids]).replace(NEWLINE, "\n")


def _sentences(docs: Sequence[Document], max_len: int = 2000) -> Iterator[str]:
    """Documents cut at line boundaries into sentences of at most ``max_len`` characters."""
    for doc in docs:
        chunk: list[str] = []
        size = 0
        for line in doc.text.replace("\n", NEWLINE + "\n").splitlines():
            line = line[:max_len]
            if size + len(line) > max_len and chunk:
                yield "".join(chunk)
                chunk, size = [], 0
            chunk.append(line)
            size += len(line)
        if chunk:
            yield "".join(chunk)


def tokenizer_cache_key(corpus_hash: str, vocab_size: int) -> str:
    """Hash of everything that determines the trained model."""
    blob = json.dumps([corpus_hash, vocab_size, _TRAIN_OPTIONS, spm.__version__], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def train_tokenizer(
    docs: Sequence[Document], corpus_hash: str, vocab_size: int, cache_dir: str | Path
) -> tuple[Path, bool]:
    """Train a BPE model on ``docs`` unless the cache has one for the same content and options.

    Returns the model path and whether it came from the cache.
    """
    if vocab_size < MIN_TRAINED_VOCAB:  # a model that comes with its own tokenizer may have any vocabulary
        raise DataError(
            f"model.vocab_size={vocab_size} (minus sentinel ids) is too small to train a byte-fallback SentencePiece "
            f"tokenizer; use at least {MIN_TRAINED_VOCAB} or set data.tokenizer to an existing .model"
        )
    out = Path(cache_dir) / "tokenizers" / tokenizer_cache_key(corpus_hash, vocab_size) / "tokenizer.model"
    if out.is_file():
        return out, True
    out.parent.mkdir(parents=True, exist_ok=True)
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_sentences(docs),
            model_writer=model,
            vocab_size=vocab_size,
            num_threads=os.cpu_count() or 1,
            minloglevel=2,
            **_TRAIN_OPTIONS,
        )
    except RuntimeError as err:
        raise DataError(
            f"SentencePiece could not train a {vocab_size}-token vocabulary on this corpus ({err}); lower "
            "model.vocab_size or add text"
        ) from None
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(model.getvalue())
    os.replace(tmp, out)
    return out, False


def _tokenizer_sample(docs: Sequence[Document], max_chars: int) -> list[Document]:
    sample, total = [], 0
    for doc in docs:
        if total >= max_chars:
            break
        sample.append(Document(doc.name, doc.text[: max_chars - total]))
        total += len(sample[-1].text)
    return sample


def train_or_load_tokenizer(
    spec: str, vocab_size: int, docs: Sequence[Document], corpus_hash: str, tokenizer_chars: int, cache_dir: str | Path
) -> tuple[Tokenizer, bool]:
    """``spec`` "default" trains SentencePiece on the first ``tokenizer_chars`` of ``docs`` (cached);
    else it is a .model path.

    Returns the tokenizer and whether it came from the cache (a given path counts as cached).
    """
    if spec == "default":
        path, cached = train_tokenizer(
            _tokenizer_sample(docs, tokenizer_chars), f"{corpus_hash}:{tokenizer_chars}", vocab_size, cache_dir
        )
        return Tokenizer(path), cached
    return Tokenizer(spec), True
