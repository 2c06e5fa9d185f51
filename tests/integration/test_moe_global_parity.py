"""MoE with the global-batch balance loss (the default) trains the single-process model on every layout.

One 4-process torchrun world trains the layouts (tests/helpers/dist_variants.py): FSDP x EP, FSDP x TP x EP
(with Qwen3-MoE's per-head QK-norm),
HSDP x EP, DP x CP, pipeline x EP, and Switch routing with capacity dropping decided over the global
batch. Each matches one process (fp32, 1e-5 relative on loss and grad norm per step, final parameter
sums of squares). The per-rank scope ("micro") on the same world is shown to differ from one process,
so the comparison can tell the two apart. A pipeline's micro-batches are accumulation steps: its
reference accumulates them (each pipeline micro-batch of every rank is a part of the global batch).
"""

from __future__ import annotations

import json

import pytest
from helpers.runs import assert_runs_match, step_records, torchrun, write_tiny_recipe

from tessera.train.trainer import train
from tessera.validate import load_config

STEPS = 4
BASE = [
    f"train.steps={STEPS}",
    "train.batch_size=8",
    "log.every=1",
    "optim.schedule=constant",
    "train.eval_every=0",
    "checkpoint.enabled=false",
    "model.tie_embeddings=false",
    "model.moe.experts=4",
    "model.moe.top_k=2",
    "model.moe.aux_loss_coef=0.05",
    "model.moe.z_loss_coef=0.001",
]
# Qwen3-MoE's per-head QK-norm: one weight over all heads, whose gradient the tp ranks' heads share.
QK_NORM = ["model.attention.qk_norm=true"]
SWITCH = ["model.moe.top_k=1", "model.moe.router=softmax_topk", "model.moe.capacity_factor=1.0"]
PP_REFERENCE = ["train.batch_size=4", "train.grad_accum=2"]
WORLD4 = {
    "dp4_ep4": ["parallel.dp_shard=4", "parallel.ep=4"],
    "dp2_tp2_ep2": ["parallel.dp_shard=2", "parallel.tp=2", "parallel.ep=2", *QK_NORM],
    "hsdp_ep2": ["parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.ep=2"],
    "dp2_cp2": ["parallel.dp_shard=2", "parallel.cp=2"],
    "pp2_ep2": ["parallel.pp=2", "parallel.dp_shard=2", "parallel.ep=2", "parallel.microbatches=2"],
    "switch_dp4_ep2": ["parallel.dp_shard=4", "parallel.ep=2", *SWITCH],
    "micro_dp4": ["parallel.dp_shard=4", "model.moe.aux_loss_scope=micro"],
}
REFERENCE_OF = {
    "dp4_ep4": "plain",
    "dp2_tp2_ep2": "qk_norm",
    "hsdp_ep2": "plain",
    "dp2_cp2": "plain",
    "pp2_ep2": "pp",
    "switch_dp4_ep2": "switch",
}
REFERENCES = {"plain": [], "qk_norm": QK_NORM, "pp": PP_REFERENCE, "switch": SWITCH}


@pytest.fixture(scope="module")
def recipe(tmp_path_factory, cache_dir):
    return write_tiny_recipe(tmp_path_factory.mktemp("moe_global") / "base.toml", cache_dir, *BASE)


@pytest.mark.slow
def test_global_balance_matches_one_process_on_every_layout(recipe, tmp_path):
    for name, overrides in REFERENCES.items():
        train(load_config(recipe, [*overrides, f"train.run_dir={tmp_path}/ref_{name}"]))
    torchrun(4, "tests/helpers/dist_variants.py", str(recipe), str(tmp_path), json.dumps(WORLD4))
    for run, reference in REFERENCE_OF.items():
        assert assert_runs_match(tmp_path / run, tmp_path / f"ref_{reference}") == STEPS, run
    dropped = [r["moe_dropped"] for r in step_records(tmp_path / "switch_dp4_ep2")]
    assert max(dropped) > 0.01, f"the capacity variant dropped nothing: {dropped}"
    with pytest.raises(AssertionError):  # the per-rank loss at dp=4 is another model
        assert_runs_match(tmp_path / "micro_dp4", tmp_path / "ref_plain", checksum=False)
