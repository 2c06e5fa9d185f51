"""Hugging Face fast tokenizers (``tokenizer.json``): loading with their special tokens, and training a byte-level BPE.

An HF tokenizer is a ``tokenizer.json`` file (the ``tokenizers`` library's format: GPT-2, Llama 3,
Qwen, Mistral's fast tokenizers) or a directory holding one. Which tokens are BOS/EOS/PAD comes
from ``tokenizer_config.json`` (and ``special_tokens_map.json``) beside it, as transformers
reads them; a bare ``tokenizer.json`` without a config is searched for the usual names
(``<|endoftext|>``, ``</s>``, ``<s>``, ...) among its special tokens. EOS is required (every
prepared document ends with it); BOS and PAD are optional.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tessera.data.sources import DataError
from tessera.errors import read_json_object

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
ROLES = ("bos", "eos", "pad")
# Names a bare tokenizer.json is searched for, per role, in order of preference.
USUAL_NAMES = {
    "bos": ("<|begin_of_text|>", "<s>", "<bos>", "<|bos|>", "<|startoftext|>"),
    "eos": ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>"),
    "pad": ("<|pad|>", "<pad>", "[PAD]", "<|padding|>"),
}
BPE_SPECIALS = ("<|endoftext|>", "<|pad|>")  # what `tessera tokenizer train --kind bpe` reserves (ids 0, 1)


def is_tokenizer_json(path: Path) -> bool:
    """Whether ``path`` is a JSON file (an HF tokenizer) rather than a SentencePiece protobuf."""
    with open(path, "rb") as f:
        return f.read(64).lstrip()[:1] == b"{"


def _token_content(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string, an AddedToken dict, or null."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _json_object(file: Path) -> dict[str, Any]:
    """A tokenizer JSON file that must hold one object: every other content is one DataError naming it."""
    return read_json_object(file, DataError, f"'{file}'", "; fix or remove it")


def read_token_config(path: Path) -> dict[str, Any] | None:
    """special_tokens_map.json overlaid by tokenizer_config.json beside ``path``; None when neither exists."""
    found: dict[str, Any] | None = None
    for name in (SPECIAL_TOKENS_MAP, TOKENIZER_CONFIG):
        file = path.parent / name
        if file.is_file():
            found = {**(found or {}), **_json_object(file)}
    return found


def _special_ids(tok, path: Path, config: dict[str, Any] | None) -> dict[str, int | None]:
    """BOS/EOS/PAD ids from the config (when it names the role), else from the usual names."""
    specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    ids: dict[str, int | None] = {}
    for role in ROLES:
        key = f"{role}_token"
        if config is not None and key in config:
            content = _token_content(config[key])
            ids[role] = None if content is None else tok.token_to_id(content)
            if content is not None and ids[role] is None:
                raise DataError(
                    f"{path.parent / TOKENIZER_CONFIG}: {key} '{content}' is not in the vocabulary of '{path}'; fix "
                    f"{key}"
                )
            continue
        ids[role] = next((tok.token_to_id(n) for n in USUAL_NAMES[role] if n in specials), None)
    if ids["eos"] is None:
        raise DataError(
            f"tokenizer '{path}' has no EOS token (tessera ends every document with it): set eos_token in "
            f"{path.parent / TOKENIZER_CONFIG}"
        )
    return ids


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json`` with its special-token ids (see the module doc)."""

    kind = "hf"

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        try:
            self.tok = RustTokenizer.from_file(str(path))
        except Exception as err:  # noqa: BLE001 - the Rust binding raises plain Exception for a malformed file
            raise DataError(f"tokenizer '{path}' is not a readable tokenizer.json: {err}") from None
        self.path = path
        self.config = read_token_config(path)
        ids = _special_ids(self.tok, path, self.config)
        self.bos_id, self.eos_id, self.pad_id = ids["bos"], ids["eos"], ids["pad"]
        self.vocab_size = max(self.tok.get_vocab(with_added_tokens=True).values()) + 1

    def piece(self, token_id: int) -> str:
        """The vocabulary entry of one id (for display)."""
        return self.tok.id_to_token(token_id) or f"<{token_id}>"

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str], threads: int = 0) -> list[list[int]]:
        """Token ids of many texts through the fast batch API (threads: the library's pool, see
        TOKENIZERS_PARALLELISM)."""
        return [e.ids for e in self.tok.encode_batch_fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; special tokens are dropped."""
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def files(self) -> list[Path]:
        """The files that make up this tokenizer (tokenizer.json first)."""
        extra = [self.path.parent / n for n in (TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP)] if self.config else []
        return [self.path] + [p for p in extra if p.is_file()]

    def save(self, directory: Path) -> Path:
        """Write ``tokenizer.json`` and a ``tokenizer_config.json`` naming the special tokens into ``directory``."""
        directory.mkdir(parents=True, exist_ok=True)
        for file in self.files():
            target = directory / (TOKENIZER_JSON if file == self.path else file.name)
            if not (target.exists() and target.samefile(file)):
                shutil.copyfile(file, target)
        if self.config is None:  # a bare tokenizer.json: record the specials found, so HF reads them too
            _write_json(directory / TOKENIZER_CONFIG, self.minimal_config())
        return directory / TOKENIZER_JSON

    def minimal_config(self) -> dict[str, Any]:
        """A tokenizer_config.json for ``PreTrainedTokenizerFast`` with this tokenizer's special tokens."""
        names = {role: getattr(self, f"{role}_id") for role in ROLES}
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
        for role, token_id in names.items():
            config[f"{role}_token"] = None if token_id is None else self.tok.id_to_token(token_id)
        return config


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


BPE_OPTIONS = {"model": "bpe", "pre_tokenizer": "byte_level", "add_prefix_space": False, "specials": BPE_SPECIALS}


def bpe_cache_key(corpus_hash: str, vocab_size: int) -> str:
    """Hash of everything that determines a trained byte-level BPE."""
    import tokenizers

    blob = json.dumps([corpus_hash, vocab_size, BPE_OPTIONS, tokenizers.__version__], sort_keys=True)
    return "bpe-" + hashlib.sha256(blob.encode()).hexdigest()[:16]


def train_bpe(texts: Iterable[str], vocab_size: int, out_dir: Path) -> Path:
    """Train a GPT-2-style byte-level BPE on ``texts``; write ``tokenizer.json`` + ``tokenizer_config.json``.

    ``<|endoftext|>`` (id 0) is BOS and EOS, ``<|pad|>`` (id 1) is PAD. The json is renamed into
    place last, so a directory holding it is complete.
    """
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(BPE_SPECIALS):
        raise DataError(f"a byte-level BPE needs a vocabulary of at least {256 + len(BPE_SPECIALS)}, got {vocab_size}")
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(BPE_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    eos, pad = BPE_SPECIALS
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    _write_json(out_dir / TOKENIZER_CONFIG, {**config, "bos_token": eos, "eos_token": eos, "pad_token": pad})
    tmp = out_dir / f"{TOKENIZER_JSON}.tmp{os.getpid()}"
    tok.save(str(tmp))
    os.replace(tmp, out_dir / TOKENIZER_JSON)
    return out_dir / TOKENIZER_JSON
