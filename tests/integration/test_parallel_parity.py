"""Parity of parallel layouts with the single-process run (fp32, 1e-5 relative, 5 steps): per-step
loss and grad norm, and the final parameters' per-tensor sum of squares.

Each layout launches one torchrun job that trains four variants: the dense decoder with
activation checkpointing off and on, and the MoE decoder with it off and on. References are
single-process runs of the same seed and data. MoE's load-balancing loss is computed on each
rank's tokens (as in Megatron), so its reference accumulates ``dp`` micro-batches of the
per-rank size, which splits the batch exactly as the data-parallel ranks do.
"""

from __future__ import annotations

import json

import pytest

from tessera.train.trainer import train

from helpers.runs import assert_runs_match, torchrun, write_tiny_recipe

STEPS = 5
BASE = [
    f"train.steps={STEPS}",
    "train.batch_size=8",
    "log.every=1",
    "optim.schedule=constant",
    "train.eval_every=0",
    "checkpoint.enabled=false",
]
MOE = [  # the per-rank ("micro") scope; the global scope: tests/integration/test_moe_global_parity.py
    "model.moe.experts=4",
    "model.moe.top_k=2",
    "model.moe.aux_loss_coef=0.01",
    "model.moe.z_loss_coef=0.001",
    "model.moe.aux_loss_scope=micro",
]

# name -> (processes, parallel overrides, data-parallel degree, activation checkpointing mode when on)
LAYOUTS = {
    "ddp2": (2, ["parallel.dp_replicate=2", "parallel.dp_shard=1"], 2, "full"),
    "fsdp2": (2, ["parallel.dp_shard=2"], 2, "selective"),
    "fsdp4": (4, ["parallel.dp_shard=4"], 4, "op"),
    "hsdp2x2": (4, ["parallel.dp_replicate=2", "parallel.dp_shard=2"], 4, "full"),
    "tp2": (2, ["parallel.dp_shard=1", "parallel.tp=2", "parallel.sequence_parallel=false"], 1, "op"),
    "tp2_sp": (2, ["parallel.dp_shard=1", "parallel.tp=2"], 1, "full"),
    "fsdp2_tp2_sp": (4, ["parallel.dp_shard=2", "parallel.tp=2"], 2, "selective"),
}


@pytest.fixture(scope="module")
def base_recipe(tmp_path_factory, cache_dir):
    return write_tiny_recipe(tmp_path_factory.mktemp("parity") / "base.toml", cache_dir, *BASE)


@pytest.fixture(scope="module")
def references(base_recipe, tmp_path_factory):
    """Single-process run directories: dense, and MoE with 1, 2 and 4 accumulated micro-batches."""
    from tessera.validate import load_config

    out = tmp_path_factory.mktemp("refs")
    refs = {"dense": train(load_config(base_recipe, [f"train.run_dir={out}/dense"])).run_dir}
    for dp in (1, 2, 4):
        overrides = [*MOE, f"train.batch_size={8 // dp}", f"train.grad_accum={dp}", f"train.run_dir={out}/moe{dp}"]
        refs[f"moe{dp}"] = train(load_config(base_recipe, overrides)).run_dir
    return refs


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name, base_recipe, references, tmp_path):
    nproc, layout, dp, ac = LAYOUTS[name]
    variants = {
        "dense": layout,
        "dense_ac": [*layout, f"parallel.activation_checkpoint={ac}"],
        "moe": [*layout, *MOE],
        "moe_ac": [*layout, *MOE, f"parallel.activation_checkpoint={ac}"],
    }
    torchrun(nproc, "tests/helpers/dist_variants.py", str(base_recipe), str(tmp_path), json.dumps(variants))
    for variant in ("dense", "dense_ac", "moe", "moe_ac"):
        assert (
            assert_runs_match(
                tmp_path / variant, references[variant.split("_")[0] if variant.startswith("dense") else f"moe{dp}"]
            )
            == STEPS
        )
