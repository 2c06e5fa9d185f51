"""An encoder-decoder (T5, configs/tiny/t5.toml) under context parallelism.

Each rank holds the zigzag slice of the encoder's sequence and of the decoder's (cut along their own lengths,
after span corruption drew each sequence's noise); the encoder attends bidirectionally over the split sequence
with T5's relative bias over global positions; the decoder's cross-attention reads the encoder memory of every
rank (all-gathered along the sequence, zigzag undone; the backward reduce-scatters its gradient). Whole training
runs at cp = 2 and 4 match one process in loss and grad norm per step, final parameter norms and validation loss (fp32, 1e-5):
the all-gather method with T5's bias (also with MoE layers), the ring method (which takes no score bias) with RoPE, and pp = 2 x cp = 2
(the memory slices cross the encoder | decoder stage boundary; the last two at lr 1e-3, see :data:`LR3`).
"""

from __future__ import annotations

import json

import pytest

from tessera.config import ConfigError
from tessera.validate import load_config
from tessera.train.trainer import train

from helpers.runs import assert_losses_close, assert_runs_match, torchrun

T5_RECIPE = "configs/tiny/t5.toml"
STEPS = 5
# seq_len 79: span corruption of 80 tokens gives encoder sequences of 72 and decoder sequences of 16 (both / 8).
BASE = [
    f"train.steps={STEPS}",
    "train.seq_len=79",
    "log.every=1",
    "optim.schedule=constant",
    "optim.warmup_steps=2",
    f"train.eval_every={STEPS}",
    "train.sample_tokens=0",
    "checkpoint.enabled=false",
]
# At the recipe's lr 1e-2 AdamW grows fp32 rounding differences of 1e-7 in steps 1-2 to 1e-5 by step 3 where the
# sums run in another order: the ring's online log-sum-exp merge (2e-5) and pp2 x cp2's two micro-batches (1.4e-5);
# at lr 1e-3 both stay at 1e-7. The all-gather method keeps the recipe's lr (cp2 and cp4: under 8e-7).
LR3 = ["optim.lr=1e-3"]
ROPE = ["model.position.kind=rope", *LR3]
# MoE in both stacks (top-2, aux and z losses): each layer's expert counts are summed over the cp ranks' slices.
MOE = ["model.moe.experts=4", "model.moe.ffn_hidden=64", "model.moe.aux_loss_coef=0.1", "model.moe.z_loss_coef=0.01"]
CP2 = ["parallel.cp=2", "parallel.dp_shard=1"]
# world size -> name -> (layout, feature overrides shared with its one-process reference)
WORLDS = {
    2: {
        "cp2": (CP2, []),
        "cp2_ring_rope": ([*CP2, "parallel.cp_method=ring"], ROPE),
        "cp2_moe": (CP2, MOE),
    },
    4: {
        "cp4": (["parallel.cp=4", "parallel.dp_shard=1"], []),
        # encoder | decoder stages: each cp rank's memory slice crosses the stage boundary, the decoder gathers it
        "pp2_cp2": ([*CP2, "parallel.pp=2", "parallel.microbatches=2"], LR3),
    },
}


def test_span_corruption_lengths_must_cut_into_2cp_chunks():
    with pytest.raises(ConfigError, match=r"encoder sequences of 58 and decoder sequences of 13 .*seq_len=57 or 61"):
        load_config(T5_RECIPE, CP2)
    load_config(T5_RECIPE, [*CP2, "train.seq_len=61"])  # 56 and 12


@pytest.mark.slow
def test_encoder_decoder_trains_under_context_parallelism(tmp_path, cache_dir):
    recipe = tmp_path / "t5.toml"
    recipe.write_text(load_config(T5_RECIPE, [*BASE, f"data.cache_dir={cache_dir}"]).to_toml())
    refs = {}
    for variants in WORLDS.values():
        for _, features in variants.values():
            if tuple(features) not in refs:
                run_dir = f"train.run_dir={tmp_path}/ref{len(refs)}"
                refs[tuple(features)] = train(load_config(recipe, [*features, run_dir])).run_dir
    for world, variants in WORLDS.items():
        runs = {name: [*layout, *features] for name, (layout, features) in variants.items()}
        torchrun(world, "tests/helpers/dist_variants.py", str(recipe), str(tmp_path), json.dumps(runs))
    for variants in WORLDS.values():
        for name, (_, features) in variants.items():
            assert assert_runs_match(tmp_path / name, refs[tuple(features)]) == STEPS, name
            assert_losses_close(_val_losses(tmp_path / name), _val_losses(refs[tuple(features)]), what="val loss")


def _val_losses(run_dir) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["val_loss"] for r in map(json.loads, lines) if "val_loss" in r]
