"""Shared fixtures: one tiny tokenized corpus per session, tiny job configs, CLI runner."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from helpers.runs import TINY_OVERRIDES

from tessera.config import JobConfig
from tessera.validate import load_config

# Two cores: keep each test process (and its children) on one thread per op.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """A session-wide tessera cache, so the tiny corpus is tokenized once for all tests."""
    path = tmp_path_factory.mktemp("tessera_cache")
    os.environ["TESSERA_CACHE"] = str(path)
    return path


@pytest.fixture(scope="session")
def small_tokenizer(cache_dir) -> Path:
    """A 300-token SentencePiece model, trained once per session on small synthetic Python snippets."""
    from tessera.data.sources import Document
    from tessera.data.tokenizer import train_tokenizer

    docs = [Document(f"d{i}", f"def f{i}(x):\n    return x * {i} + 'text'\n\n") for i in range(200)]
    return train_tokenizer(docs, "small-tokenizer", 300, cache_dir)[0]


@pytest.fixture
def tiny_config(tmp_path, cache_dir):
    """A factory of validated tiny JobConfigs writing into a fresh run directory."""

    def make(*overrides: str, run_dir: Path | None = None) -> JobConfig:
        run = run_dir or tmp_path / "run"
        return load_config(None, TINY_OVERRIDES + [f"train.run_dir={run}", f"data.cache_dir={cache_dir}", *overrides])

    return make
