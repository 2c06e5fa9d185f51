"""Blends and splits over megatron-core indexed datasets (megatron's GPTDataset + blending helper)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from helpers.data import EOD, write_megatron_dataset

from tessera.data.blend import build_splits, parse_blend, parse_split, split_ranges
from tessera.data.loader import SequenceLoader
from tessera.data.sources import DataError
from tessera.train.trainer import train


@pytest.fixture(scope="module")
def two_datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("blend")
    write_megatron_dataset(root / "web", 3000, 10, 100, seed=1)
    write_megatron_dataset(root / "code", 2000, 200, 290, seed=2)
    return root


def test_parse_blend_and_split():
    assert parse_blend("data/web") == (["data/web"], None)
    assert parse_blend("7 a 3 b") == (["a", "b"], [0.7, 0.3])
    with pytest.raises(DataError, match=r"weight 'x0.7' for 'a' is not a number"):
        parse_blend("x0.7 a 0.3 b")
    with pytest.raises(DataError, match="has 3 items"):
        parse_blend("0.7 a 0.3")
    with pytest.raises(DataError, match="weight -1 for 'b' must be a positive"):
        parse_blend("1 a -1 b")
    assert parse_split("98,1,1") == pytest.approx([0.98, 0.01, 0.01]) and parse_split("9,1") == pytest.approx(
        [0.9, 0.1, 0.0]
    )
    with pytest.raises(DataError, match="data.split '0,1,1'"):
        parse_split("0,1,1")
    assert split_ranges(100, [0.9, 0.1, 0.0]) == [(0, 90), (90, 100), None]


def test_realized_mix_over_10000_samples_is_within_one_percent(two_datasets, tmp_path):
    blend = f"0.7 {two_datasets / 'web'} 0.3 {two_datasets / 'code'}"
    splits = build_splits(blend, "98,1,1", 32, 1234, EOD, 300, tmp_path)
    train_split = splits["train"]
    loader = SequenceLoader(train_split, batch_size=100, seed=1234, prefetch=0)
    ids = loader.sample_ids(0, 10_000)
    share = np.mean([train_split.source_of(int(i)) == 0 for i in ids])
    assert abs(share - 0.7) < 0.01
    for i in ids[:200]:  # the samples really come from the dataset the index names
        window = train_split[int(i)]
        body = window[window != EOD]
        assert ((body < 100) if train_split.source_of(int(i)) == 0 else (body >= 200)).all()
    assert splits["valid"] is not None and splits["test"] is not None and len(splits["valid"]) > 0


def test_indices_are_cached_on_disk_and_deterministic(two_datasets, tmp_path):
    blend = f"0.5 {two_datasets / 'web'} 0.5 {two_datasets / 'code'}"
    first = build_splits(blend, "90,10", 32, 7, EOD, 300, tmp_path)["train"]
    cached = sorted(p.name for p in (tmp_path / "indices").rglob("*.npy"))
    assert any(n.startswith("blend-") for n in cached) and any("GPTDataset-train-shuffle_index" in n for n in cached)
    mtimes = {p: p.stat().st_mtime_ns for p in (tmp_path / "indices").rglob("*.npy")}
    again = build_splits(blend, "90,10", 32, 7, EOD, 300, tmp_path)["train"]
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "indices").rglob("*.npy")} == mtimes  # loaded, not rebuilt
    assert all(np.array_equal(first[i], again[i]) for i in range(0, len(first), 97))
    other_seed = build_splits(blend, "90,10", 32, 8, EOD, 300, tmp_path)["train"]
    assert not all(np.array_equal(first[i], other_seed[i]) for i in range(20))


def test_splits_hold_disjoint_documents(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    builder = IndexedDatasetBuilder(f"{tmp_path / 'docs'}.bin", dtype=np.uint16)
    for d in range(400):  # document d is made of token 10 + d only
        doc = np.append(np.full(40, 10 + d), EOD)
        builder.add_document(torch.from_numpy(doc), [len(doc)])
    builder.finalize(f"{tmp_path / 'docs'}.idx")
    splits = build_splits(str(tmp_path / "docs"), "80,10,10", 16, 0, EOD, 1000, tmp_path)
    seen = {}
    for name in ("train", "valid", "test"):
        ds = splits[name]
        seen[name] = {int(t) - 10 for i in range(len(ds)) for t in ds[i] if t != EOD}
    assert (
        seen["train"] == set(range(320))
        and seen["valid"] == set(range(320, 360))
        and seen["test"] == set(range(360, 400))
    )


def test_megatron_written_dataset_trains_in_tessera_with_and_without_document_masks(
    two_datasets, tiny_config, small_tokenizer, tmp_path
):
    blend = f"0.6 {two_datasets / 'web'} 0.4 {two_datasets / 'code'}"
    common = (
        "train.steps=3",
        "train.eval_every=3",
        "checkpoint.every=3",
        f"data.blend={blend}",
        f"data.tokenizer={small_tokenizer}",
        "data.split=98,2,0",
    )
    plain = train(tiny_config(*common, run_dir=tmp_path / "plain"))
    masked = train(
        tiny_config(*common, "data.document_mask=true", "data.mask_eod_loss=true", run_dir=tmp_path / "masked")
    )
    for result in (plain, masked):
        assert len(result.losses) == 3 and all(math.isfinite(x) for x in result.losses) and 3 in result.val_losses
    assert masked.losses[0] != plain.losses[0]  # same weights and tokens: the masks reached the model and the loss
