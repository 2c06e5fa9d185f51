"""Tokenizers behind one interface: SentencePiece ``.model`` files and Hugging Face ``tokenizer.json``.

``Tokenizer(path)`` opens any of: a SentencePiece model, an HF ``tokenizer.json``, or a directory
holding either (``tokenizer.json`` wins, as in transformers' fast tokenizers). The format is
read from the file's content, not its name. Every kind offers the same ``encode``,
``encode_batch``, ``decode``, ``vocab_size`` and ``bos_id``/``eos_id``/``pad_id`` (BOS and PAD may
be None; EOS is required). This module also trains tessera's default SentencePiece BPE (cached
by content hash); :mod:`tessera.data.hf_tokenizer` trains a byte-level BPE.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import sentencepiece as spm

from tessera.data.hf_tokenizer import (
    SPECIAL_TOKENS_MAP,
    TOKENIZER_CONFIG,
    TOKENIZER_JSON,
    HFTokenizer,
    bpe_cache_key,
    is_tokenizer_json,
    train_bpe,
)
from tessera.data.sources import DataError, Document

SENTENCEPIECE_MODEL = "tokenizer.model"
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


class SentencePieceTokenizer:
    """A SentencePiece model; tessera's own models keep newlines through the ``NEWLINE`` piece."""

    kind = "sentencepiece"

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.LoadFromSerializedProto(path.read_bytes())
        except RuntimeError as err:
            raise DataError(f"tokenizer '{path}' is not a SentencePiece model: {err}") from None
        self.vocab_size = self.sp.get_piece_size()
        self.bos_id, self.eos_id, self.pad_id = (
            i if i >= 0 else None for i in (self.sp.bos_id(), self.sp.eos_id(), self.sp.pad_id())
        )
        if self.eos_id is None:
            raise DataError(f"SentencePiece model '{path}' has no EOS token (tessera ends every document with it)")
        # Models trained elsewhere (Llama 2, T5) encode newlines themselves (byte fallback); only ours map them.
        self.newline = NEWLINE if self.sp.piece_to_id(NEWLINE) != self.sp.unk_id() else None

    def piece(self, token_id: int) -> str:
        """The vocabulary entry of one id (for display)."""
        return self.sp.id_to_piece(token_id)

    def _in(self, text: str) -> str:
        return text.replace("\n", self.newline) if self.newline else text

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added)."""
        return self.sp.encode(self._in(text))

    def encode_batch(self, texts: Sequence[str], threads: int = 0) -> list[list[int]]:
        """Token ids of many texts at once on ``threads`` SentencePiece threads (0 = all cores)."""
        return self.sp.encode([self._in(t) for t in texts], num_threads=threads or os.cpu_count() or 1)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; special tokens are dropped."""
        text = self.sp.decode([int(i) for i in ids])
        return text.replace(self.newline, "\n") if self.newline else text

    def files(self) -> list[Path]:
        """The one file of this tokenizer."""
        return [self.path]

    def save(self, directory: Path) -> Path:
        """Copy the model to ``directory/tokenizer.model`` (removing an HF tokenizer.json there, which would win)."""
        directory.mkdir(parents=True, exist_ok=True)
        target = directory / SENTENCEPIECE_MODEL
        if not (target.exists() and target.samefile(self.path)):
            shutil.copyfile(self.path, target)
        (directory / TOKENIZER_JSON).unlink(missing_ok=True)
        return target


def _locate(path: Path) -> Path:
    """The tokenizer file of ``path``: itself, or the tokenizer.json / tokenizer.model of a directory."""
    if path.is_dir():
        for name in (TOKENIZER_JSON, SENTENCEPIECE_MODEL):
            if (path / name).is_file():
                return path / name
        raise DataError(
            f"'{path}' holds no {TOKENIZER_JSON} or {SENTENCEPIECE_MODEL}; give a tokenizer file or a directory "
            "holding one (a run directory keeps the tokenizer it trained with)"
        )
    if not path.is_file():
        raise DataError(
            f"tokenizer '{path}' does not exist; train one with 'tessera tokenizer train' or set data.tokenizer to a "
            ".model, tokenizer.json or HF tokenizer directory"
        )
    return path


class Tokenizer:
    """Any supported tokenizer, opened from a file or directory (see the module doc)."""

    def __init__(self, path: str | Path) -> None:
        self.source = Path(path)
        self.path = _locate(self.source)
        backend = HFTokenizer if is_tokenizer_json(self.path) else SentencePieceTokenizer
        self.backend: HFTokenizer | SentencePieceTokenizer = backend(self.path)
        self.kind: str = self.backend.kind
        self.vocab_size: int = self.backend.vocab_size
        self.bos_id: int | None = self.backend.bos_id
        self.eos_id: int = self.backend.eos_id
        self.pad_id: int | None = self.backend.pad_id

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return self.backend.encode(text)

    def encode_batch(self, texts: Sequence[str], threads: int = 0) -> list[list[int]]:
        """Token ids of many texts through the backend's batch API."""
        return self.backend.encode_batch(texts, threads)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; special tokens are dropped."""
        return self.backend.decode(ids)

    def piece(self, token_id: int) -> str:
        """The vocabulary entry of one id (for display; ``<id>`` outside the vocabulary)."""
        return self.backend.piece(token_id) if 0 <= token_id < self.vocab_size else f"<{token_id}>"

    def prompt_ids(self, text: str) -> list[int]:
        """``text`` as a generation prompt: BOS (when the tokenizer has one) then its tokens."""
        return ([] if self.bos_id is None else [self.bos_id]) + self.encode(text)

    def save(self, directory: str | Path) -> Path:
        """Write this tokenizer's files into ``directory`` so ``Tokenizer(directory)`` (and HF, for HF
        kinds) reads it."""
        return self.backend.save(Path(directory))

    @property
    def fingerprint(self) -> str:
        """Hash of the tokenizer's files and special ids: equal fingerprints tokenize identically."""
        digest = hashlib.sha256(json.dumps([self.kind, self.bos_id, self.eos_id, self.pad_id]).encode())
        for file in self.backend.files():
            digest.update(file.read_bytes())
        return digest.hexdigest()


def copy_tokenizer_files(source_dir: str | Path, target_dir: str | Path) -> list[Path]:
    """Copy every tokenizer file of an HF model directory (fast and SentencePiece, with their configs)."""
    names = (TOKENIZER_JSON, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP, SENTENCEPIECE_MODEL)
    found = [Path(source_dir) / n for n in names if (Path(source_dir) / n).is_file()]
    for file in found:
        shutil.copyfile(file, Path(target_dir) / file.name)
    return found


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


def train_bpe_tokenizer(
    docs: Sequence[Document], corpus_hash: str, vocab_size: int, cache_dir: str | Path
) -> tuple[Path, bool]:
    """Train a byte-level BPE (``tokenizer.json``) on ``docs`` unless the cache has one for the same content.

    Returns the ``tokenizer.json`` path and whether it came from the cache.
    """
    out = Path(cache_dir) / "tokenizers" / bpe_cache_key(corpus_hash, vocab_size)
    if (out / TOKENIZER_JSON).is_file():
        return out / TOKENIZER_JSON, True
    return train_bpe((d.text for d in docs), vocab_size, out), False


TRAINED_KINDS = {"default": train_tokenizer, "bpe": train_bpe_tokenizer}  # data.tokenizer values that train one


def train_or_load_tokenizer(
    spec: str, vocab_size: int, docs: Sequence[Document], corpus_hash: str, tokenizer_chars: int, cache_dir: str | Path
) -> tuple[Tokenizer, bool]:
    """``spec`` "default" trains SentencePiece, "bpe" a byte-level BPE, on the first ``tokenizer_chars`` of
    ``docs`` (cached); else it is a tokenizer file or directory (see :class:`Tokenizer`).

    Returns the tokenizer and whether it came from the cache (a given path counts as cached).
    """
    if spec in TRAINED_KINDS:
        path, cached = TRAINED_KINDS[spec](
            _tokenizer_sample(docs, tokenizer_chars), f"{corpus_hash}:{tokenizer_chars}", vocab_size, cache_dir
        )
        return Tokenizer(path), cached
    return Tokenizer(spec), True
