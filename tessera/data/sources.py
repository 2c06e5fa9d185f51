"""Text corpora: the built-in default corpus and local text files or folders.

The default corpus is the Python standard library of the running interpreter (found through
``sysconfig``): it is on every machine tessera runs on, needs no download, and is read in a
fixed order so every run sees the same text.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


class DataError(ValueError):
    """A user-caused data problem (missing file, empty corpus, bad index); one line with the fix."""


@dataclass(frozen=True)
class Document:
    """One document: where it came from and its text."""

    name: str
    text: str


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
        raise DataError(f"data.source '{path}' does not exist; give a text file, a folder of text files, or 'default'")
    if path.is_file():
        return [(path.name, path)]
    files = sorted(f for f in path.rglob("*") if f.is_file() and not f.name.startswith("."))
    return [(f.relative_to(path).as_posix(), f) for f in files]


def iter_documents(source: str, max_chars: int = 0) -> Iterator[Document]:
    """Documents of ``source`` ("default" or a path) in a fixed order, up to ``max_chars`` characters."""
    files = _default_files() if source == "default" else _local_files(Path(source))
    total = 0
    for name, path in files:
        text = path.read_bytes().decode("utf-8", errors="replace")
        if not text.strip():
            continue
        if max_chars and total + len(text) > max_chars:
            text = text[: max_chars - total]
        total += len(text)
        yield Document(name, text)
        if max_chars and total >= max_chars:
            return


def load_corpus(source: str, max_chars: int = 0) -> tuple[list[Document], str]:
    """All documents of ``source`` and a content hash of them (the cache key of derived files)."""
    docs = list(iter_documents(source, max_chars))
    if not docs:
        raise DataError(f"data.source '{source}' has no non-empty text documents; point it at text files")
    digest = hashlib.sha256()
    for doc in docs:
        digest.update(doc.name.encode())
        digest.update(b"\0")
        digest.update(doc.text.encode())
        digest.update(b"\0")
    return docs, digest.hexdigest()
