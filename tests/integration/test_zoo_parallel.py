"""A Mamba + latent-attention hybrid under DDP, FSDP (with activation checkpointing) and pipeline stages
matches the single-process run on losses, grad norms and final parameters (fp32, 1e-5 relative, 4 steps):
the compatibility table's "yes" for these layouts is measured, not assumed."""

from __future__ import annotations

import json

import pytest

from tessera.validate import load_config
from tessera.train.trainer import train

from helpers.runs import assert_runs_match, torchrun, write_tiny_recipe

HYBRID = [
    "train.steps=4",
    "train.batch_size=8",
    "log.every=1",
    "optim.schedule=constant",
    "train.eval_every=0",
    "checkpoint.enabled=false",
    "model.n_layers=4",
    "model.layer_pattern=MA",
    "model.mamba.state=8",
    "model.mamba.chunk=8",
    "model.mla.kv_rank=16",
    "model.mla.q_rank=16",
    "model.mla.rope_head_dim=8",
    "model.mla.nope_head_dim=8",
    "model.mla.v_head_dim=16",
]
LAYOUTS = {
    "ddp": ["parallel.dp_replicate=2", "parallel.dp_shard=1"],
    "fsdp_ac": ["parallel.dp_shard=2", "parallel.activation_checkpoint=full"],
    "pp": ["parallel.pp=2", "parallel.dp_shard=1"],
}


@pytest.mark.slow
def test_hybrid_layouts_match_single_process(tmp_path, cache_dir):
    recipe = write_tiny_recipe(tmp_path / "hybrid.toml", cache_dir, *HYBRID)
    reference = train(load_config(recipe, [f"train.run_dir={tmp_path}/single"])).run_dir
    torchrun(2, "tests/helpers/dist_variants.py", str(recipe), str(tmp_path), json.dumps(LAYOUTS))
    for name in LAYOUTS:
        assert assert_runs_match(tmp_path / name, reference) == 4  # losses, grad norms, final parameters
