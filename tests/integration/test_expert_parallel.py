"""Expert parallelism: per-block equality, whole-run parity (fp32, 1e-5 relative on loss AND grad norm, 5
steps, and the final parameters) with the single-process run, and checkpoints that reshard across ep sizes.

Two torchrun worlds train every layout (tests/helpers/dist_variants.py). On 2 processes: ep=2 with the
router variants (top-2 with compiled blocks; switch with capacity dropping; DeepSeek-V3 routing
with the aux-free bias, a per-sequence aux loss and a gated shared expert), an encoder-decoder,
ep=2 over the tp ranks with sequence parallelism, and bf16 (close, not equal). On 4 processes:
ep=4, ep=2 x efsdp=2, ep=2 x HSDP (activation checkpointing), pp=2 x ep=2, ep=4 over 2 fsdp x
2 tp ranks without sequence parallelism, and ep=2 over the tp ranks beside 2 data replicas.
Checkpoints saved at ep=2 resume at ep=4 and on one process, and a single-process checkpoint
resumes at ep=4. The MoE auxiliary losses (and capacity) are computed on each data-parallel
rank's tokens, so a reference accumulates ``dp`` micro-batches of the per-rank size
(tests/integration/test_parallel_parity.py).
"""

from __future__ import annotations

import json
import shutil

import pytest
from helpers.runs import assert_losses_close, assert_runs_match, torchrun, write_tiny_recipe

from tessera.validate import load_config
from tessera.train.metrics import read_metrics
from tessera.train.trainer import train

STEPS = 5
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
    "model.moe.aux_loss_coef=0.01",
    "model.moe.z_loss_coef=0.001",
    "model.moe.aux_loss_scope=micro",
    "model.moe.capacity_scope=micro",  # per-rank balance and capacity; the global scope: tests/integration
]
MOE = {
    "top2": [],
    "switch_capacity": ["model.moe.top_k=1", "model.moe.router=softmax_topk", "model.moe.capacity_factor=1.0"],
    "deepseek": [  # sigmoid scores, group-limited top-k, aux-free bias, per-sequence aux loss, gated shared expert
        "model.moe.router=sigmoid",
        "model.moe.groups=2",
        "model.moe.topk_groups=1",
        "model.moe.bias_update_rate=0.01",
        "model.moe.aux_loss_scope=sequence",
        "model.moe.route_scale=2.0",
        "model.moe.shared_experts=1",
        "model.moe.shared_gate=true",
    ],
    "t5": [  # an encoder-decoder: both stacks' MoE layers
        "model.arch=encoder_decoder",
        "model.objective=span_corruption",
        "model.vocab_size=520",
        "model.sentinel_tokens=8",
    ],
}
EP2 = ["parallel.dp_shard=2", "parallel.ep=2"]
WORLD2 = {
    **{f"ep2_{name}": [*EP2, *overrides] for name, overrides in MOE.items()},
    "ep2_top2": [*EP2, "parallel.compile=true"],
    "ep2_tp2_sp": ["parallel.dp_shard=1", "parallel.tp=2", "parallel.ep=2"],
    "ep2_bf16": [*EP2, "train.dtype=bf16"],  # grouped matmuls, FSDP mixed precision: close to fp32, not equal
}
WORLD4 = {
    "ep4": ["parallel.dp_shard=4", "parallel.ep=4"],
    "ep2_efsdp2": ["parallel.dp_shard=4", "parallel.ep=2"],
    "ep2_hsdp": [
        "parallel.dp_replicate=2",
        "parallel.dp_shard=2",
        "parallel.ep=2",
        "parallel.activation_checkpoint=full",
    ],
    "pp2_ep2": ["parallel.pp=2", "parallel.dp_shard=2", "parallel.ep=2", "parallel.microbatches=2"],
    "ep4_tp2_fsdp2": ["parallel.dp_shard=2", "parallel.tp=2", "parallel.ep=4", "parallel.sequence_parallel=false"],
    "ddp2_tp2_ep2": ["parallel.dp_replicate=2", "parallel.dp_shard=1", "parallel.tp=2", "parallel.ep=2"],
}
# run -> (router variant, per-rank micro-batches of the reference)
REFERENCE_OF = {
    **{f"ep2_{name}": (name, 2) for name in MOE},
    "ep2_tp2_sp": ("top2", 1),
    "ep4": ("top2", 4),
    "ep2_efsdp2": ("top2", 4),
    "ep2_hsdp": ("top2", 4),
    "pp2_ep2": ("top2", 4),  # 2 data ranks x 2 pipeline micro-batches
    "ep4_tp2_fsdp2": ("top2", 2),
    "ddp2_tp2_ep2": ("top2", 2),
}
# Resharding: no aux losses and no dropping, so the losses do not depend on how the batch is split.
RESHARD = [
    "train.steps=8",
    "checkpoint.enabled=true",
    "checkpoint.every=4",
    "model.moe.aux_loss_coef=0",
    "model.moe.z_loss_coef=0",
]


def _curves(run_dir) -> tuple[list[float], list[float]]:
    records = [r for r in read_metrics(run_dir) if "loss" in r]
    return [r["loss"] for r in records], [r["grad_norm"] for r in records]


def _resume_copy(src, dst) -> None:
    shutil.copytree(src, dst)
    shutil.rmtree(dst / "checkpoints" / "step_00000008", ignore_errors=True)


@pytest.fixture(scope="module")
def recipe(tmp_path_factory, cache_dir):
    return write_tiny_recipe(tmp_path_factory.mktemp("ep") / "base.toml", cache_dir, *BASE)


@pytest.fixture(scope="module")
def references(recipe, tmp_path_factory):
    """Single-process runs: each needed (router variant, micro-batches) and the 8-step resharding run."""
    out = tmp_path_factory.mktemp("ep_refs")
    for name, micro in sorted(set(REFERENCE_OF.values())):
        overrides = [*MOE[name], f"train.batch_size={8 // micro}", f"train.grad_accum={micro}"]
        train(load_config(recipe, [*overrides, f"train.run_dir={out}/{name}_{micro}"]))
    train(load_config(recipe, [*RESHARD, f"train.run_dir={out}/reshard"]))
    return out


@pytest.mark.slow
def test_expert_parallel_blocks_match_the_single_device_block():
    result = torchrun(4, "tests/helpers/dist_ep_blocks.py")
    assert "all expert-parallel blocks match" in result.stderr


@pytest.mark.slow
def test_expert_parallel_layouts_match_one_process_and_reshard(recipe, references, tmp_path):
    world2 = {**WORLD2, "ep2_reshard": [*EP2, *RESHARD]}
    torchrun(2, "tests/helpers/dist_variants.py", str(recipe), str(tmp_path), json.dumps(world2))
    _resume_copy(tmp_path / "ep2_reshard", tmp_path / "ep2_to_ep4")
    _resume_copy(references / "reshard", tmp_path / "single_to_ep4")
    _resume_copy(tmp_path / "ep2_reshard", tmp_path / "ep2_to_single")
    resumed = {name: ["parallel.dp_shard=4", "parallel.ep=4", *RESHARD] for name in ("ep2_to_ep4", "single_to_ep4")}
    torchrun(4, "tests/helpers/dist_variants.py", str(recipe), str(tmp_path), json.dumps({**WORLD4, **resumed}))
    train(load_config(recipe, [*RESHARD, f"train.run_dir={tmp_path}/ep2_to_single"]))

    for run, (name, micro) in REFERENCE_OF.items():
        assert_runs_match(tmp_path / run, references / f"{name}_{micro}")
    for run in ("ep2_reshard", "ep2_to_ep4", "single_to_ep4", "ep2_to_single"):
        assert_runs_match(tmp_path / run, references / "reshard")
    assert_losses_close(_curves(tmp_path / "ep2_bf16")[0], _curves(references / "top2_2")[0], rtol=2e-2)
    dropped = [r["moe_dropped"] for r in read_metrics(tmp_path / "ep2_switch_capacity") if "loss" in r]
    assert max(dropped) > 0.01, f"the capacity variant dropped nothing: {dropped}"
    load = json.loads((tmp_path / "ep4" / "expert_load.json").read_text())["layers"]
    assert len(load) == 2 and sum(load[0]["assignments"]) == 8 * 32 * 2 * STEPS  # every rank's tokens, top-2
