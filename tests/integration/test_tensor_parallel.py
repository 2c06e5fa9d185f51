"""Per-layer tensor-parallel checks (see tests/helpers/dist_tp_blocks.py) and the TP plan's error paths."""

from __future__ import annotations

import pytest

from tessera.config import ConfigError
from tessera.validate import load_config

from helpers.runs import torchrun


def test_every_sharded_block_matches_its_unsharded_twin():
    result = torchrun(2, "tests/helpers/dist_tp_blocks.py")
    assert "all blocks match" in result.stderr


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["parallel.tp=2", "model.n_heads=4", "model.n_kv_heads=1"],
            "model.n_kv_heads=1 is not divisible by parallel.tp=2",
        ),
        (
            ["parallel.tp=3", "model.dim=96", "model.n_heads=3", "model.n_kv_heads=3", "model.vocab_size=2048"],
            "model.vocab_size=2048 is not divisible by parallel.tp=3",
        ),
        (
            ["parallel.tp=2", "train.seq_len=33", "model.max_seq_len=64"],
            "train.seq_len=33 is not divisible by parallel.tp=2",
        ),
        (  # latent attention splits its heads after the low-rank projections: they must divide too
            ["parallel.tp=2", "model.n_heads=3", "model.dim=96", "model.mla.kv_rank=16", "model.mla.rope_head_dim=8"],
            "model.n_heads=3 is not divisible by parallel.tp=2",
        ),
        (["parallel.pp=4", "model.n_layers=2"], "4 pipeline stages (pp=4 x 1 per rank) but model.n_layers=2"),
        (
            ["parallel.dp_shard=4", "train.batch_size=6"],
            "train.batch_size=6 (global) is not divisible by the data-parallel degree 4",
        ),
        (["parallel.cpu_offload=true", "parallel.dp_shard=1"], "cpu offload (CUDA) with single"),
    ],
)
def test_impossible_layouts_fail_before_any_process_starts(overrides, message):
    with pytest.raises(ConfigError, match=None) as err:
        load_config(None, ["model.tie_embeddings=false", *overrides])
    assert message in str(err.value)
