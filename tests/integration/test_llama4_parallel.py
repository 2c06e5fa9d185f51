"""Llama 4's attention options (chunked attention across the TP/SP shards, the QK L2 norm on the RoPE layer,
temperature tuning on the NoPE layer) with its input-scaled top-1 MoE and shared expert, under tp2 (+SP), pp2
(the RoPE layer on one stage, the NoPE layer on the other) and ep2: losses, grad norms and final parameters equal the
single-process run (fp32, 1e-5 relative, 3 steps), all layouts in one spawned 2-process world."""

from __future__ import annotations

import json

import pytest

from tessera.validate import load_config
from tessera.train.trainer import train

from helpers.runs import assert_runs_match, torchrun, write_tiny_recipe

LLAMA4 = [
    "train.steps=3",
    "log.every=1",
    "optim.schedule=constant",
    "train.eval_every=0",
    "checkpoint.enabled=false",
    "model.n_layers=2",
    "model.layer_pattern=AG",
    "model.position.nope_layers=1",
    "model.attention.chunk_size=8",  # 4 chunks in each 32-token sequence
    "model.attention.qk_l2_norm=true",
    "model.attention.temperature_tuning=true",
    "model.attention.temperature_floor=4",  # the scale grows along the sequence
    "model.attention.temperature_scale=0.5",
    "model.moe.experts=4",
    "model.moe.top_k=1",
    "model.moe.router=sigmoid",
    "model.moe.norm_topk=false",
    "model.moe.scale_input=true",
    "model.moe.shared_experts=1",
    "model.moe.ffn_hidden=48",
    "model.moe.aux_loss_coef=0.0",
]
LAYOUTS = {
    "tp2_sp": ["parallel.tp=2", "parallel.dp_shard=1", "parallel.sequence_parallel=true"],
    "pp2": ["parallel.pp=2", "parallel.dp_shard=1"],
    "ep2": ["parallel.ep=2", "parallel.dp_shard=2"],  # the input-scaled rows all-to-all'd to their experts
}


@pytest.mark.slow
def test_llama4_options_match_single_process(tmp_path, cache_dir):
    recipe = write_tiny_recipe(tmp_path / "llama4.toml", cache_dir, *LLAMA4)
    reference = train(load_config(recipe, [f"train.run_dir={tmp_path}/single"])).run_dir
    torchrun(2, "tests/helpers/dist_variants.py", str(recipe), str(tmp_path), json.dumps(LAYOUTS))
    for name in LAYOUTS:  # losses, grad norms, final parameters
        assert assert_runs_match(tmp_path / name, reference) == 3, name
