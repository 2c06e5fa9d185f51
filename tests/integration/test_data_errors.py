"""Bad data input: one clear line naming the file, exit code 2, before any training step."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from helpers.data import write_megatron_dataset

from helpers.runs import run_cli


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    root = tmp_path_factory.mktemp("good")
    write_megatron_dataset(root / "data", 200, 10, 250)
    return root / "data"


def _copy(good, dest):
    dest.parent.mkdir(parents=True, exist_ok=True)
    for ext in (".bin", ".idx"):
        shutil.copyfile(f"{good}{ext}", f"{dest}{ext}")
    return dest


def _fails_with(result, *fragments: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tessera: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_missing_dataset_file(tmp_path):
    _fails_with(run_cli("data", "inspect", str(tmp_path / "nope")), f"'{tmp_path / 'nope'}.bin' does not exist")


def test_empty_corpus(tmp_path, cache_dir):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("  \n")
    result = run_cli(
        "prepare", str(tmp_path / "empty"), "--output", str(tmp_path / "out"), env={"TESSERA_CACHE": str(cache_dir)}
    )
    _fails_with(result, f"'{tmp_path / 'empty'}' has no non-empty text documents")
    assert not (tmp_path / "out.bin").exists()


def test_truncated_bin(good, tmp_path):
    bad = _copy(good, tmp_path / "cut")
    with open(f"{bad}.bin", "r+b") as f:
        f.truncate(f.seek(0, 2) - 10)
    _fails_with(run_cli("data", "inspect", str(bad)), f"'{bad}.bin' is truncated or corrupted")


def test_corrupted_idx(good, tmp_path):
    bad = _copy(good, tmp_path / "garbled")
    with open(f"{bad}.idx", "r+b") as f:
        f.write(b"NOTMMIDX!")
    _fails_with(run_cli("data", "inspect", str(bad)), f"'{bad}.idx' is unreadable", "bad header")


def test_token_dtype_too_small_for_the_vocab(tmp_path, small_tokenizer):
    narrow = tmp_path / "narrow"
    write_megatron_dataset(narrow, 50, 10, 250, dtype=np.uint8)  # 256 ids; the tokenizer has 300
    run = tmp_path / "run"
    result = run_cli(
        "train",
        "configs/smoke.toml",
        f"data.blend={narrow}",
        f"data.tokenizer={small_tokenizer}",
        f"train.run_dir={run}",
    )
    _fails_with(result, f"'{narrow}.bin' stores tokens as uint8", "tokenizer has 300 tokens")
    assert not (run / "metrics.jsonl").exists()


def test_unparseable_blend_weights(good, tmp_path, small_tokenizer):
    result = run_cli(
        "train",
        "configs/smoke.toml",
        f"data.blend=x0.7 {good} 0.3 {good}",
        f"data.tokenizer={small_tokenizer}",
        f"train.run_dir={tmp_path / 'run'}",
    )
    _fails_with(result, f"weight 'x0.7' for '{good}' is not a number")
