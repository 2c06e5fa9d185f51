"""Attention sinks with alternating windowed and global layers (gpt-oss-shaped) under tp2 (+SP), cp2 (ring,
the window crossing the rank boundary) and pp2, and with gpt-oss's biased experts under ep2, match the single-process run on losses, grad norms and final
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
# gpt-oss's MoE: 4 biased experts with the clamped SwiGLU (top-2, biased router), their banks and biases
# sharded over ep=2 (the experts' rows all-to-all'd to the rank that holds them).
GPT_OSS_MOE = [
    "model.moe.experts=4",
    "model.moe.top_k=2",
    "model.moe.router_bias=true",
    "model.moe.expert_biases=true",
    "model.moe.swiglu_limit=7",
    "model.moe.ffn_hidden=48",
]
MOE_LAYOUTS = {"moe_ep2": [*GPT_OSS_MOE, "parallel.ep=2", "parallel.dp_shard=2"]}


@pytest.mark.slow
def test_sinks_and_windows_match_single_process(tmp_path, cache_dir):
    recipe = write_tiny_recipe(tmp_path / "sinks.toml", cache_dir, *SINKS)
    reference = train(load_config(recipe, [f"train.run_dir={tmp_path}/single"])).run_dir
    moe_reference = train(load_config(recipe, [*GPT_OSS_MOE, f"train.run_dir={tmp_path}/moe_single"])).run_dir
    layouts = {**LAYOUTS, **MOE_LAYOUTS}
    torchrun(2, "tests/helpers/dist_variants.py", str(recipe), str(tmp_path), json.dumps(layouts))
    for name in layouts:  # losses, grad norms, final parameters
        assert assert_runs_match(tmp_path / name, moe_reference if name in MOE_LAYOUTS else reference) == 3, name
