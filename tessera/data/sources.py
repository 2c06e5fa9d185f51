"""Text corpora: the built-in default corpus, local files and folders, Hugging Face hub datasets.

The default corpus is the Python standard library of the running interpreter (found through
``sysconfig``): it is on every machine tessera runs on, needs no download, and is read in a
fixed order so every run sees the same text.

Local sources are a file or a folder (read recursively, in sorted order). Files ending in
``.json``/``.jsonl``, ``.parquet`` or ``.arrow`` are read with HF ``datasets`` in streaming mode
(one row at a time, so inputs larger than memory work) and each row's ``text_field`` is a
document; every other file is one plain-text document. ``hf:NAME`` (or ``owner/name`` when no
such local path exists) names a dataset on the Hugging Face hub.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import socket
import sysconfig
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tessera.errors import DataError


@dataclass(frozen=True)
class Document:
    """One document: where it came from and its text."""

    name: str
    text: str


# File suffix -> the HF datasets builder that reads it (rows with a text field).
STRUCTURED = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow"}
HUB_PREFIX = "hf:"
_HUB_NAME = re.compile(r"^[\w.-]+/[\w.-]+$")
HUB_HOST = ("huggingface.co", 443)


def default_corpus_root() -> Path:
    """The running interpreter's standard-library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def _default_files() -> list[tuple[str, Path]]:
    root = default_corpus_root()
    files: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "__pycache__")]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath) / name
                files.append((path.relative_to(root).as_posix(), path))
    return sorted(files)


def _local_files(path: Path) -> list[tuple[str, Path]]:
    if not path.exists():
        raise DataError(
            f"data source '{path}' does not exist; give a text/JSON/JSONL/Parquet/Arrow file, a folder of them, "
            "'hf:NAME' or 'default'"
        )
    if path.is_file():
        return [(path.name, path)]
    files = sorted(
        f for f in path.rglob("*") if f.is_file() and not any(p.startswith(".") for p in f.relative_to(path).parts)
    )
    return [(f.relative_to(path).as_posix(), f) for f in files]


def is_hub_name(source: str) -> bool:
    """Whether ``source`` names a Hugging Face hub dataset rather than a local path."""
    return source.startswith(HUB_PREFIX) or (_HUB_NAME.match(source) is not None and not Path(source).exists())


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub answers within ``timeout`` seconds (DNS included); False offline."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0") or os.environ.get("HF_DATASETS_OFFLINE", "0") not in (
        "",
        "0",
    ):
        return False
    result: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection(HUB_HOST, timeout=timeout).close()
            result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(result and result[0])


def _rows_text(rows, text_field: str, where: str) -> Iterator[str]:
    for i, row in enumerate(rows):
        if text_field not in row:
            raise DataError(
                f"'{where}' row {i} has no field '{text_field}' (fields: {', '.join(sorted(row))}); set "
                "data.text_field / --text-field"
            )
        value = row[text_field]
        if not isinstance(value, str):
            raise DataError(
                f"'{where}' row {i}: field '{text_field}' is {type(value).__name__}, not text; set data.text_field / "
                "--text-field"
            )
        yield value


def _structured_texts(path: Path, text_field: str) -> Iterator[str]:
    import datasets

    datasets.disable_progress_bars()
    # A builder logs the failure it then raises; tessera reports it (below) in one line of its own.
    builder = STRUCTURED[path.suffix]
    logging.getLogger(f"datasets.packaged_modules.{builder}.{builder}").setLevel(logging.CRITICAL)
    try:
        rows = datasets.load_dataset(STRUCTURED[path.suffix], data_files=[str(path)], split="train", streaming=True)
        yield from _rows_text(rows, text_field, str(path))
    except DataError:
        raise
    except Exception as err:  # pyarrow/json decoders raise many types; each means an unreadable file
        raise DataError(
            f"'{path}' could not be read as {STRUCTURED[path.suffix]} ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''})"
        ) from None


def _hub_texts(source: str, text_field: str) -> Iterator[str]:
    name = source.removeprefix(HUB_PREFIX)
    if not hub_reachable():
        raise DataError(
            f"data source '{source}' is a Hugging Face hub dataset but this machine is offline (huggingface.co "
            "unreachable); "
            "download it where there is a network (e.g. to Parquet) and give the local path instead"
        )
    import datasets

    repo, _, subset = name.partition(":")
    try:
        rows = datasets.load_dataset(repo, subset or None, split="train", streaming=True)
    except Exception as err:  # hub errors come in many types; each means the name cannot be loaded
        raise DataError(
            f"hub dataset '{repo}' could not be loaded ({type(err).__name__}: {err}); check the name"
        ) from None
    yield from _rows_text(rows, text_field, source)


_BINARY_SHARE = 0.01  # undecodable bytes beyond this share of a file: binary, not text with a few bad bytes


def decode_text(path: Path) -> str | None:
    """The text of a plain-text source file (a few invalid UTF-8 bytes become U+FFFD), or None when the file
    is binary: a NUL byte, or more than 1% of it undecodable (random bytes would tokenize as "text")."""
    data = path.read_bytes()
    if b"\0" in data[:65536]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("utf-8", errors="replace")
    return None if text.count("\ufffd") > _BINARY_SHARE * max(len(text), 1) else text


def no_documents(source: str, text_field: str) -> DataError:
    """The error of a source without any non-empty text document (it names the source, not an output)."""
    return DataError(
        f"data source '{source}' has no non-empty text documents; point it at text or at rows with a "
        f"'{text_field}' field"
    )


def iter_texts(source: str, text_field: str = "text", skipped: list[str] | None = None) -> Iterator[tuple[str, str]]:
    """``(name, text)`` of every document of ``source`` in a fixed order (empty texts included). Binary files
    of a folder are left out, their names appended to ``skipped``; a binary file given alone is a DataError."""
    if source == "default":
        for name, path in _default_files():
            yield name, path.read_bytes().decode("utf-8", errors="replace")
        return
    if is_hub_name(source):
        for i, text in enumerate(_hub_texts(source, text_field)):
            yield f"{source}#{i}", text
        return
    for name, path in _local_files(Path(source)):
        if path.suffix in STRUCTURED:
            for i, text in enumerate(_structured_texts(path, text_field)):
                yield f"{name}#{i}", text
            continue
        text = decode_text(path)
        if text is None and Path(source).is_file():
            raise DataError(
                f"data source '{source}' is a binary file, not UTF-8 text; give text, JSON(L), Parquet or Arrow files"
            )
        if text is None:
            if skipped is not None:
                skipped.append(name)
            continue
        yield name, text


def iter_documents(
    source: str, max_chars: int = 0, text_field: str = "text", skipped: list[str] | None = None
) -> Iterator[Document]:
    """Non-empty documents of ``source`` in a fixed order, up to ``max_chars`` characters (0 = all); binary files
    of a folder go to ``skipped`` (see :func:`iter_texts`)."""
    total = 0
    for name, text in iter_texts(source, text_field, skipped):
        if not text.strip():
            continue
        if max_chars and total + len(text) > max_chars:
            text = text[: max_chars - total]
        total += len(text)
        yield Document(name, text)
        if max_chars and total >= max_chars:
            return


def corpus_hash(docs: list[Document]) -> str:
    """A content hash of documents (the cache key of derived files)."""
    digest = hashlib.sha256()
    for doc in docs:
        digest.update(doc.name.encode())
        digest.update(b"\0")
        digest.update(doc.text.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def load_corpus(source: str, max_chars: int = 0, text_field: str = "text") -> tuple[list[Document], str]:
    """All documents of ``source`` and a content hash of them; an empty corpus is a DataError."""
    docs = list(iter_documents(source, max_chars, text_field))
    if not docs:
        raise no_documents(source, text_field)
    return docs, corpus_hash(docs)
