"""Loading never runs code: DCP metadata that declares what tessera never writes is refused, and so are
cached dataset indices that are not plain NumPy files (megatron would unpickle them)."""

from __future__ import annotations

import io
import pathlib
import pickle
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from conftest import run_cli
from tessera.api import load
from tessera.validate import load_config
from tessera.model import build_model
from tessera.train import checkpoint as checkpoint_module
from tessera.train.checkpoint import CheckpointError, Checkpointer
from test_blend import EOD, write_megatron_dataset

TINY_MODEL = ["model.vocab_size=512", "model.dim=32", "model.n_layers=1", "model.n_heads=2", "model.max_seq_len=64"]
TARGET = "model.tok_embeddings.weight"


class MarkerPayload:
    """Unpickling this (with weights_only=False) creates a marker file: proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def tiny_run(run: Path) -> Path:
    """A run directory with one real tessera checkpoint (no training) and the run's config."""
    config = load_config(None, [*TINY_MODEL, "train.seq_len=32", f"train.run_dir={run}"])
    model = build_model(config.model)
    extra = {"config": config.to_dict(), "model": config.to_dict()["model"]}
    ckpt = Checkpointer(run, 1).save(0, model, torch.optim.AdamW(model.parameters()), extra)
    (run / "config.toml").write_text(config.to_toml(), encoding="utf-8")
    return ckpt


def plant_bytes_entry(ckpt: Path, marker: Path, relative_path: str = "__payload.distcp") -> None:
    """Rewrite ``.metadata`` (only DCP classes, which the allow-list accepts) so TARGET is a pickled payload."""
    meta_path = ckpt / ".metadata"
    metadata = pickle.loads(meta_path.read_bytes())
    buffer = io.BytesIO()
    torch.save(MarkerPayload(marker), buffer)
    (ckpt / "__payload.distcp").write_bytes(buffer.getvalue())
    metadata.state_dict_metadata[TARGET] = BytesStorageMetadata()
    for index in [i for i in metadata.storage_data if i.fqn == TARGET]:
        del metadata.storage_data[index]
    metadata.storage_data[MetadataIndex(TARGET)] = _StorageInfo(relative_path, 0, len(buffer.getvalue()))
    meta_path.write_bytes(pickle.dumps(metadata))


def test_generate_refuses_a_bytes_entry_without_running_it(tmp_path):
    run, marker = tmp_path / "run", tmp_path / "MARKER"
    ckpt = tiny_run(run)
    (run / "tokenizer.model").write_bytes(b"")
    plant_bytes_entry(ckpt, marker)
    result = run_cli("generate", str(run), "--max-new-tokens", "2")
    assert not marker.exists(), "the checkpoint's payload ran"
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert str(ckpt / ".metadata") in result.stderr and "BytesStorageMetadata" in result.stderr


def test_bytes_entries_are_read_weights_only_even_past_the_metadata_check(tmp_path, monkeypatch):
    run, marker = tmp_path / "run", tmp_path / "MARKER"
    plant_bytes_entry(tiny_run(run), marker)
    monkeypatch.setattr(checkpoint_module, "_check_entries", lambda metadata, path: None)
    with pytest.raises(CheckpointError):
        load(run)
    assert not marker.exists(), "DCP unpickled a bytes entry with weights_only=False"


def test_shard_files_outside_the_checkpoint_are_refused(tmp_path):
    run = tmp_path / "run"
    ckpt = tiny_run(run)
    plant_bytes_entry(ckpt, tmp_path / "MARKER")
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())
    metadata.state_dict_metadata[TARGET] = pickle.loads((ckpt / ".metadata").read_bytes()).state_dict_metadata[
        "model.output.weight"
    ]
    metadata.storage_data[MetadataIndex(TARGET)] = _StorageInfo("../../../etc/passwd", 0, 10)
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match=r"stores 'model.tok_embeddings.weight' in '\.\./\.\./\.\./etc/passwd'"):
        load(run)


def test_metadata_that_is_not_dcp_metadata_is_refused(tmp_path):
    run = tmp_path / "run"
    ckpt = tiny_run(run)
    (ckpt / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    with pytest.raises(CheckpointError, match=r"holds a dict, not DCP metadata"):
        load(run)


def test_an_untouched_checkpoint_still_loads(tmp_path):
    run = tmp_path / "run"
    tiny_run(run)
    assert load(run)(torch.zeros(1, 4, dtype=torch.long)).shape == (1, 4, 512)


def test_a_planted_index_cache_file_is_refused_not_unpickled(tmp_path):
    from tessera.data.blend import build_splits
    from tessera.data.sources import DataError

    prefix, cache, marker = tmp_path / "data", tmp_path / "cache", tmp_path / "MARKER"
    write_megatron_dataset(prefix, 200, 10, 250)
    build_splits(str(prefix), "98,2,0", 32, 1, EOD, 300, cache)  # writes megatron's index cache
    planted = next(cache.rglob("*train-shuffle_index.npy"))
    planted.write_bytes(pickle.dumps(MarkerPayload(marker)))
    with pytest.raises(DataError, match=rf"cached index '{planted}' is not a NumPy array file"):
        build_splits(str(prefix), "98,2,0", 32, 1, EOD, 300, cache)
    assert not marker.exists(), "megatron unpickled the planted cache file"
