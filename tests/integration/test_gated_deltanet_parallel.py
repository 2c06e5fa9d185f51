"""A Qwen3-Next-shaped hybrid (Gated DeltaNet + gated attention with per-head QK-norm, zero-centred norms, partial
rotary, MoE with a gated shared expert) with a Kimi Delta Attention layer between them (a per-channel decay; its
low-rank decay and gate projections split and gathered) under tp2 + SP, pipeline stages and cp2 (chunk summaries
combined over the ranks, convolution halos from the rank before), also with document masks at cp2; the same hybrid
with Mamba-2 + elu+1 attention at tp2 + SP and cp2, and Mamba-2 + softmax attention at cp2 with document masks: each
matches its single-process run on losses, grad norms and final parameters (fp32, 1e-5 relative, 4 steps), all in
one spawned world of 2. Layer level, with spread-out weights: tp and SP without it for every recurrent mixer
(tests/helpers/dist_tp_blocks.py), cp2 / cp4 with document boundaries inside a rank's slice and on a rank boundary
(tests/helpers/dist_cp.py)."""

from __future__ import annotations

import json
import random

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
MAMBA = [
    "model.n_layers=2",
    "model.layer_pattern=MA",
    "model.mamba.state=8",
    "model.mamba.head_dim=16",
    "model.mamba.chunk=8",
]
MIXERS = {  # model variant -> its overrides (each has its own single-process reference)
    "gdn": [],
    "gdn_docs": ["data.document_mask=true"],
    "mamba2_linear": [*MAMBA, "model.mamba.version=2", "model.mamba.groups=2", "model.attention.kernel=linear"],
    "mamba2_docs": [*MAMBA, "model.mamba.version=2", "data.document_mask=true"],
}
TP2 = ["parallel.tp=2", "parallel.dp_shard=1"]
SP = ["parallel.sequence_parallel=true"]
CP2 = ["parallel.cp=2", "parallel.dp_shard=1"]
LAYOUTS = {  # name -> (layout, model variant)
    "tp2_sp": ([*TP2, *SP], "gdn"),
    "pp2": (["parallel.pp=2", "parallel.dp_shard=1"], "gdn"),
    "cp2": (CP2, "gdn"),
    "cp2_docs": (CP2, "gdn_docs"),
    "tp2_sp_mamba2_linear": ([*TP2, *SP], "mamba2_linear"),
    "cp2_mamba2_linear": (CP2, "mamba2_linear"),
    "cp2_mamba2_docs": (CP2, "mamba2_docs"),
}


def _short_documents(path, small_tokenizer) -> list[str]:
    """A corpus of short documents (3 to 30 words): every sequence of 32 tokens holds several boundaries, inside
    a rank's slice and across the rank boundary."""
    rng = random.Random(0)
    words = ["def", "return", "x", "f(x):", "*", "+", "'text'", "if", "else", "for", "in", "range(3):", "=", "1"]
    with open(path, "w") as f:
        for _ in range(600):
            f.write(json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(3, 30)))}) + "\n")
    return [f"data.source={path}", f"data.tokenizer={small_tokenizer}"]


@pytest.mark.slow
def test_recurrent_hybrid_layouts_match_single_process(tmp_path, cache_dir, small_tokenizer):
    corpus = _short_documents(tmp_path / "docs.jsonl", small_tokenizer)
    recipe = write_tiny_recipe(tmp_path / "qwen3_next.toml", cache_dir, *QWEN3_NEXT, *corpus)
    references = {
        name: train(load_config(recipe, [*overrides, f"train.run_dir={tmp_path}/single_{name}"])).run_dir
        for name, overrides in MIXERS.items()
    }
    variants = {name: [*layout, *MIXERS[model]] for name, (layout, model) in LAYOUTS.items()}
    torchrun(2, "tests/helpers/dist_variants.py", str(recipe), str(tmp_path), json.dumps(variants))
    for name, (_, model) in LAYOUTS.items():
        assert assert_runs_match(tmp_path / name, references[model]) == 4, name  # losses, grad norms, parameters


def test_key_heads_not_divisible_by_tp_is_one_clear_error(tiny_config):
    with pytest.raises(ConfigError, match=r"model.gdn.key_heads=3 is not divisible by parallel.tp=2"):
        tiny_config(
            "parallel.tp=2",
            "parallel.dp_shard=1",
            "model.layer_pattern=DA",
            "model.gdn.key_heads=3",
            "model.gdn.value_heads=6",
        )


def test_mamba2_groups_not_divisible_by_tp_is_one_clear_error(tiny_config):
    with pytest.raises(ConfigError, match=r"Mamba-2 under parallel.tp=2 needs whole heads .*model.mamba.groups=1"):
        tiny_config(
            "parallel.tp=2",
            "parallel.dp_shard=1",
            "model.layer_pattern=MA",
            "model.mamba.version=2",
            "model.mamba.head_dim=16",
        )


def test_chunk_not_dividing_the_local_piece_is_one_clear_error(tiny_config):
    with pytest.raises(ConfigError, match=r"model.gdn.chunk=16 does not divide the local sequence piece .* = 8"):
        tiny_config("parallel.cp=2", "parallel.dp_shard=1", "model.layer_pattern=DA", "model.gdn.chunk=16")


def test_kda_heads_not_divisible_by_tp_is_one_clear_error(tiny_config):
    with pytest.raises(ConfigError, match=r"model.kda.heads=3 is not divisible by parallel.tp=2"):
        tiny_config("parallel.tp=2", "parallel.dp_shard=1", "model.layer_pattern=KA", "model.kda.heads=3")


def test_kda_chunk_not_dividing_the_local_piece_is_one_clear_error(tiny_config):
    with pytest.raises(ConfigError, match=r"model.kda.chunk=16 does not divide the local sequence piece .* = 8"):
        tiny_config("parallel.cp=2", "parallel.dp_shard=1", "model.layer_pattern=KA", "model.kda.chunk=16")


def test_mamba_conv_wider_than_the_local_piece_is_one_clear_error(tiny_config):
    with pytest.raises(ConfigError, match=r"model.mamba.conv=10 is wider than the local sequence piece"):
        tiny_config("parallel.cp=2", "parallel.dp_shard=1", "model.layer_pattern=MA", "model.mamba.conv=10")
