"""A Qwen3-Next-shaped hybrid (Gated DeltaNet + gated attention with per-head QK-norm, zero-centred norms, partial
rotary, MoE with a gated shared expert) with a Kimi Delta Attention layer between them (a per-channel decay; its
low-rank decay and gate projections split and gathered) under tp2, tp2 + SP, pipeline stages and cp2 (chunk
summaries combined over the ranks, convolution halos from the rank before) matches the single-process run on
losses, grad norms and final parameters (fp32, 1e-5 relative, 4 steps), in one spawned world of 2."""

from __future__ import annotations

import json

import pytest

from tessera.config import ConfigError
from tessera.validate import load_config
from tessera.train.trainer import train

from helpers.runs import assert_runs_match, torchrun, write_tiny_recipe

QWEN3_NEXT = [
    "train.steps=4",
    "train.batch_size=4",
    "optim.schedule=constant",
    "train.eval_every=0",
    "checkpoint.enabled=false",
    "model.n_layers=3",
    "model.layer_pattern=DKA",
    "model.head_dim=16",
    "model.norm=zero_centered_rmsnorm",
    "model.attention.qk_norm=true",
    "model.attention.output_gate=true",
    "model.position.rotary_fraction=0.25",
    "model.gdn.key_heads=2",
    "model.gdn.value_heads=4",
    "model.gdn.key_head_dim=16",
    "model.gdn.value_head_dim=16",
    "model.gdn.chunk=8",
    "model.kda.heads=2",
    "model.kda.head_dim=16",
    "model.kda.chunk=8",
    "model.moe.experts=4",
    "model.moe.ffn_hidden=32",
    "model.moe.shared_experts=1",
    "model.moe.shared_gate=true",
    # The balance loss of a micro-batch is not that of the batch (pp splits it): the parity is of the model itself.
    "model.moe.aux_loss_coef=0.0",
]
LAYOUTS = {
    "tp2": ["parallel.tp=2", "parallel.dp_shard=1"],
    "tp2_sp": ["parallel.tp=2", "parallel.dp_shard=1", "parallel.sequence_parallel=true"],
    "pp2": ["parallel.pp=2", "parallel.dp_shard=1"],
    "cp2": ["parallel.cp=2", "parallel.dp_shard=1"],
}


@pytest.mark.slow
def test_qwen3_next_hybrid_layouts_match_single_process(tmp_path, cache_dir):
    recipe = write_tiny_recipe(tmp_path / "qwen3_next.toml", cache_dir, *QWEN3_NEXT)
    reference = train(load_config(recipe, [f"train.run_dir={tmp_path}/single"])).run_dir
    torchrun(2, "tests/helpers/dist_variants.py", str(recipe), str(tmp_path), json.dumps(LAYOUTS))
    for name in LAYOUTS:
        assert assert_runs_match(tmp_path / name, reference) == 4, name  # losses, grad norms, final parameters


def test_key_heads_not_divisible_by_tp_is_one_clear_error(tiny_config):
    with pytest.raises(ConfigError, match=r"model.gdn.key_heads=3 is not divisible by parallel.tp=2"):
        tiny_config(
            "parallel.tp=2",
            "parallel.dp_shard=1",
            "model.layer_pattern=DA",
            "model.gdn.key_heads=3",
            "model.gdn.value_heads=6",
        )


def test_gated_deltanet_with_tp_and_fsdp_is_refused(tiny_config):
    with pytest.raises(ConfigError, match=r"Gated DeltaNet layers with parallel.tp > 1 and FSDP"):
        tiny_config("parallel.tp=2", "parallel.dp_shard=2", "model.layer_pattern=DA")


def test_chunk_not_dividing_the_local_piece_is_one_clear_error(tiny_config):
    with pytest.raises(ConfigError, match=r"model.gdn.chunk=16 does not divide the local sequence piece .* = 8"):
        tiny_config("parallel.cp=2", "parallel.dp_shard=1", "model.layer_pattern=DA", "model.gdn.chunk=16")


def test_kda_heads_not_divisible_by_tp_is_one_clear_error(tiny_config):
    with pytest.raises(ConfigError, match=r"model.kda.heads=3 is not divisible by parallel.tp=2"):
        tiny_config("parallel.tp=2", "parallel.dp_shard=1", "model.layer_pattern=KA", "model.kda.heads=3")


def test_kda_chunk_not_dividing_the_local_piece_is_one_clear_error(tiny_config):
    with pytest.raises(ConfigError, match=r"model.kda.chunk=16 does not divide the local sequence piece .* = 8"):
        tiny_config("parallel.cp=2", "parallel.dp_shard=1", "model.layer_pattern=KA", "model.kda.chunk=16")
