"""tessera prepare: parallel tokenization into megatron-core indexed datasets, atomic, inspectable."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from tessera.data import prepare as prep
from tessera.data.prepare import prepare_source, token_dtype
from tessera.data.tokenizer import Tokenizer

from helpers.runs import run_cli


def _megatron_reader(prefix):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    return IndexedDataset(str(prefix))


def _jsonl(path, n: int = 700) -> list[str]:
    texts = [f"def f{i}(x):\n    return x * {i}\n" * (1 + i % 5) for i in range(n)]
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    return texts


def test_token_dtype_follows_vocab_size():
    assert [token_dtype(v) for v in (300, 65536, 65537, 200_000)] == [np.uint16, np.uint16, np.int32, np.int32]


def test_files_read_back_with_megatrons_reader_in_parallel_and_serial(tmp_path, small_tokenizer):
    texts = _jsonl(tmp_path / "rows.jsonl")
    tok = Tokenizer(small_tokenizer)
    one = prepare_source(str(tmp_path / "rows.jsonl"), tmp_path / "one", tok, num_proc=1)
    two = prepare_source(str(tmp_path / "rows.jsonl"), tmp_path / "two", tok, num_proc=2)
    assert (one.documents, two.documents) == (700, 700) and one.tokens == two.tokens and one.dtype == "uint16"
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"one{ext}").read_bytes() == (tmp_path / f"two{ext}").read_bytes()
    reader = _megatron_reader(tmp_path / "one")
    assert len(reader) == 700 and reader.index.dtype == np.uint16
    for i in (0, 1, 350, 699):
        assert reader[i].tolist() == tok.encode(texts[i]) + [tok.eos_id]
    assert int(reader.sequence_lengths.sum()) == one.tokens


def test_interrupted_run_leaves_no_files(tmp_path, small_tokenizer, monkeypatch):
    _jsonl(tmp_path / "rows.jsonl", 600)
    real = prep._encoded

    def dies_after_first_chunk(*args):
        gen = real(*args)
        yield next(gen)
        raise KeyboardInterrupt

    monkeypatch.setattr(prep, "_encoded", dies_after_first_chunk)
    with pytest.raises(KeyboardInterrupt):
        prepare_source(str(tmp_path / "rows.jsonl"), tmp_path / "out" / "data", Tokenizer(small_tokenizer))
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.slow  # two CLI processes: ~15 s alone, over 30 s on a loaded 2-core machine
def test_cli_prepare_then_inspect(tmp_path, cache_dir):
    _jsonl(tmp_path / "rows.jsonl", 300)
    out = tmp_path / "prepared" / "code"
    env = {"TESSERA_CACHE": str(cache_dir)}
    done = run_cli(
        "prepare", str(tmp_path / "rows.jsonl"), "--output", str(out), "--vocab-size", "300", "--num-proc", "2", env=env
    )
    assert done.returncode == 0, done.stderr
    assert (
        "prepared 300 documents" in done.stdout and "tokens/s" in done.stdout and "prepare code" in done.stderr
    )  # summary + progress bar
    written = sorted(p.name for p in out.parent.iterdir())
    assert written == ["code.bin", "code.idx", "code.tokenizer.json", "code.tokenizer.model"]
    shown = run_cli("data", "inspect", f"{out}.idx", env=env)
    assert shown.returncode == 0, shown.stderr
    reader = _megatron_reader(out)  # keep it alive: megatron closes the mmap its arrays view on deletion
    tokens = int(reader.sequence_lengths.sum())
    assert "documents   300" in shown.stdout and f"tokens      {tokens:,}" in shown.stdout
    assert "length histogram" in shown.stdout and "sample: document 299" in shown.stdout
    assert "def f299(x):\n      return x * 299" in shown.stdout  # decoded with the kept tokenizer
