"""Muon across layouts: parity with the single-process run (fp32, 1e-5 relative, 5 steps) on per-step loss and
grad norm and the final parameters, for FSDP=2, TP=2, PP=2, DDP=2 (2 processes) and FSDP=4, HSDP 2x2, FSDP=2 x TP=2 (4
processes); Muon momentum checkpointed in DCP and resumed under other layouts.
With expert parallelism (EP=2 on 2 processes; EP=2 x efsdp=2 and PP=2 x EP=2 on 4) each rank orthogonalizes its
local experts' matrices with no communication, and the runs match the single-process MoE run too.

Every run has QK-clip on with a threshold below the tiny model's logits, so the heads are rescaled at every step
and the clip is part of the parity. The MoE variant puts (E, in, out) expert stacks under Muon (each expert
orthogonalized alone); its load-balancing loss is per rank, so its reference accumulates dp micro-batches.
Each world first checks the sharded Newton-Schulz bitwise on hand-made DTensors (tests/helpers/dist_muon.py).
"""

from __future__ import annotations

import json
import shutil

import pytest
from helpers.runs import assert_runs_match, step_records, torchrun, write_tiny_recipe

from tessera.validate import load_config
from tessera.train.checkpoint import SafeFileSystemReader
from tessera.train.trainer import train

STEPS = 5
MUON = ["optim.name=muon", "optim.muon_lr=0.02", "optim.muon_ns_dtype=fp32", "optim.qk_clip_threshold=0.1"]
BASE = [
    f"train.steps={STEPS}",
    "train.batch_size=8",
    "log.every=1",
    "optim.schedule=constant",
    "train.eval_every=0",
    "checkpoint.every=3",
    "model.tie_embeddings=false",
    *MUON,
]
MOE = ["model.moe.experts=4", "model.moe.top_k=2", "model.moe.aux_loss_coef=0.01", "model.moe.aux_loss_scope=micro"]
FSDP2, TP2, PP2, DDP2 = (
    ["parallel.dp_shard=2"],
    ["parallel.dp_shard=1", "parallel.tp=2"],
    ["parallel.pp=2", "parallel.dp_shard=1"],
    ["parallel.dp_replicate=2", "parallel.dp_shard=1"],
)


def _without_last_checkpoint(src, dst) -> None:
    """``src``'s run directory as it was after step 3."""
    shutil.copytree(src, dst)
    shutil.rmtree(dst / "checkpoints" / f"step_{STEPS:08d}")


@pytest.mark.slow
def test_muon_matches_single_process_in_every_layout_and_reshards(tmp_path, cache_dir):
    recipe = write_tiny_recipe(tmp_path / "muon.toml", cache_dir, *BASE)
    ref = train(load_config(recipe, [f"train.run_dir={tmp_path}/ref"])).run_dir
    moe_ref = train(
        load_config(recipe, [*MOE, "train.batch_size=4", "train.grad_accum=2", f"train.run_dir={tmp_path}/moe_ref"])
    )
    moe_ref4 = train(  # the reference of 4 data-parallel micro-batches
        load_config(recipe, [*MOE, "train.batch_size=2", "train.grad_accum=4", f"train.run_dir={tmp_path}/moe_ref4"])
    )
    assert max(r["max_logit/layers.0.attention"] for r in step_records(ref)) > 0.1  # the clip really acts

    two = {
        "fsdp2": FSDP2,
        "tp2": TP2,
        "pp2": PP2,
        "ddp2": DDP2,
        "moe_fsdp2": [*FSDP2, *MOE],
        "moe_ep2": [*FSDP2, "parallel.ep=2", *MOE],
    }
    torchrun(2, "tests/helpers/dist_muon.py", str(recipe), str(tmp_path), json.dumps(two))
    _without_last_checkpoint(tmp_path / "fsdp2", tmp_path / "fsdp2_to_hsdp")
    four = {
        "fsdp4": ["parallel.dp_shard=4"],
        "hsdp": ["parallel.dp_replicate=2", "parallel.dp_shard=2"],
        "fsdp2_tp2": ["parallel.dp_shard=2", "parallel.tp=2"],
        "fsdp2_to_hsdp": ["parallel.dp_replicate=2", "parallel.dp_shard=2"],
        "moe_ep2_efsdp2": ["parallel.dp_shard=4", "parallel.ep=2", *MOE],
        "moe_pp2_ep2": ["parallel.pp=2", "parallel.dp_shard=2", "parallel.ep=2", "parallel.microbatches=2", *MOE],
    }
    torchrun(4, "tests/helpers/dist_muon.py", str(recipe), str(tmp_path), json.dumps(four))
    _without_last_checkpoint(tmp_path / "fsdp2_tp2", tmp_path / "fsdp2_tp2_to_single")
    train(load_config(recipe, [f"train.run_dir={tmp_path}/fsdp2_tp2_to_single"]))

    for name in ("fsdp2", "tp2", "pp2", "ddp2", "fsdp4", "hsdp", "fsdp2_tp2"):
        assert assert_runs_match(tmp_path / name, ref) == STEPS, name
    for name in ("moe_fsdp2", "moe_ep2"):
        assert assert_runs_match(tmp_path / name, moe_ref.run_dir) == STEPS, name
    for name in ("moe_ep2_efsdp2", "moe_pp2_ep2"):
        assert assert_runs_match(tmp_path / name, moe_ref4.run_dir) == STEPS, name
    for name in ("fsdp2_to_hsdp", "fsdp2_tp2_to_single"):  # the steps trained after resuming at step 3
        assert assert_runs_match(tmp_path / name, ref, after=3) == STEPS - 3, name

    saved = SafeFileSystemReader(str(tmp_path / "fsdp2" / "checkpoints" / "step_00000003")).read_metadata()
    momentum = [k for k in saved.state_dict_metadata if k.endswith("q_proj.weight.momentum_buffer")]
    assert len(momentum) == 2 and not any("q_proj.weight.exp_avg" in k for k in saved.state_dict_metadata)
