"""Attention sinks with alternating windowed and global layers (gpt-oss-shaped) under tp2 (+SP), cp2 (ring,
the window crossing the rank boundary) and pp2 match the single-process run on losses, grad norms and final
parameters (fp32, 1e-5 relative, 3 steps), all layouts in one spawned 2-process world. The layer-level CP
proof and its negative control (the sink entered once per rank) are in test_context_parallel.py."""

from __future__ import annotations

import json

import pytest

from tessera.validate import load_config
from tessera.train.trainer import train

from helpers.runs import assert_runs_match, torchrun, write_tiny_recipe

SINKS = [
    "train.steps=3",
    "log.every=1",
    "optim.schedule=constant",
    "optim.lr=1e-2",  # the sinks (zero at init) move enough in a step for a head mix-up to show in the loss
    "train.eval_every=0",
    "checkpoint.enabled=false",
    "model.n_layers=2",
    "model.layer_pattern=AG",
    "model.attention.sinks=true",
    "model.attention.sliding_window=6",
    "model.attention.qkv_bias=true",
    "model.attention.o_bias=true",
]
LAYOUTS = {
    "tp2_sp": ["parallel.tp=2", "parallel.dp_shard=1", "parallel.sequence_parallel=true"],
    "cp2_ring": ["parallel.cp=2", "parallel.dp_shard=1", "parallel.cp_method=ring"],
    "pp2": ["parallel.pp=2", "parallel.dp_shard=1"],
}


@pytest.mark.slow
def test_sinks_and_windows_match_single_process(tmp_path, cache_dir):
    recipe = write_tiny_recipe(tmp_path / "sinks.toml", cache_dir, *SINKS)
    reference = train(load_config(recipe, [f"train.run_dir={tmp_path}/single"])).run_dir
    torchrun(2, "tests/helpers/dist_variants.py", str(recipe), str(tmp_path), json.dumps(LAYOUTS))
    for name in LAYOUTS:
        assert assert_runs_match(tmp_path / name, reference) == 3, name  # losses, grad norms, final parameters
