"""Pipeline parallelism: parity with the single-process run (fp32, 1e-5 relative, 6 steps) on
per-step loss and grad norm and the final parameters' per-tensor sum of squares.

Each torchrun launch trains several variants in one process group (tests/helpers/dist_variants.py).
Every run evaluates through the pipeline at steps 0 and 6 and checkpoints at steps 3 and 6;
validation losses are compared too. MoE's auxiliary losses are computed per micro-batch, so the
MoE reference accumulates ``microbatches`` micro-batches of that size (as for data parallelism).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tessera.api import load
from tessera.validate import load_config
from tessera.train.metrics import read_metrics
from tessera.train.trainer import train

from helpers.runs import assert_losses_close, assert_runs_match, run_cli, torchrun, write_tiny_recipe

STEPS = 6
BASE = [
    f"train.steps={STEPS}",
    "train.batch_size=8",
    "model.n_layers=4",
    "log.every=1",
    "optim.schedule=constant",
    "train.eval_every=0",
    "checkpoint.every=3",
]
MOE = ["model.moe.experts=4", "model.moe.top_k=2", "model.moe.aux_loss_coef=0.01", "model.moe.z_loss_coef=0.001"]
PP2 = ["parallel.pp=2", "parallel.dp_shard=1"]


def _val_losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in read_metrics(run_dir) if "val_loss" in r}


def _assert_run_matches(run_dir, reference_dir, validation: bool = True, after: int = 0) -> None:
    """Training steps past ``after`` (a resumed run's own) and, optionally, its validation losses."""
    assert assert_runs_match(run_dir, reference_dir, after=after) == STEPS - after
    if not validation:
        return
    got = {s: v for s, v in _val_losses(run_dir).items() if s > after}
    want = {s: v for s, v in _val_losses(reference_dir).items() if s > after}
    assert got.keys() == want.keys() and got
    assert_losses_close(list(got.values()), list(want.values()))


def _resume_copy(src, dst) -> None:
    """``src``'s run directory as it was after step 3 (its step-6 checkpoint removed)."""
    shutil.copytree(src, dst)
    shutil.rmtree(dst / "checkpoints" / f"step_{STEPS:08d}")


@pytest.fixture(scope="module")
def recipe(tmp_path_factory, cache_dir):
    return write_tiny_recipe(tmp_path_factory.mktemp("pipeline") / "base.toml", cache_dir, *BASE)


@pytest.fixture(scope="module")
def references(recipe, tmp_path_factory):
    """Single-process run directories: dense, and MoE accumulating 2 micro-batches of 4."""
    out = tmp_path_factory.mktemp("pipeline_refs")
    train(load_config(recipe, [f"train.run_dir={out}/dense"]))
    train(load_config(recipe, [*MOE, "train.batch_size=4", "train.grad_accum=2", f"train.run_dir={out}/moe"]))
    return out


@pytest.mark.slow
def test_schedules_moe_and_checkpoints_across_layouts(recipe, references, tmp_path):
    _resume_copy(references / "dense", tmp_path / "single_to_pp2")
    variants = {
        "gpipe": [*PP2, "parallel.pp_schedule=gpipe", "parallel.microbatches=4", "parallel.layers_per_stage=cost"],
        "1f1b": [*PP2, "parallel.pp_schedule=1f1b", "parallel.microbatches=2", "parallel.layers_per_stage=1,3"],
        "interleaved_1f1b": [*PP2, "parallel.pp_schedule=interleaved_1f1b", "parallel.microbatches=2"],
        "interleaved_zb": [*PP2, "parallel.pp_schedule=interleaved_zb", "parallel.microbatches=4"],
        # V schedules: rank 0 runs stages 0 and 3, rank 1 stages 1 and 2
        "zbv": [*PP2, "parallel.pp_schedule=zbv", "parallel.microbatches=4"],
        "dualpipev": [*PP2, "parallel.pp_schedule=dualpipev", "parallel.microbatches=4"],
        "moe": [*PP2, *MOE, "parallel.microbatches=2"],
        "single_to_pp2": [*PP2, "parallel.microbatches=2"],
    }
    torchrun(2, "tests/helpers/dist_variants.py", str(recipe), str(tmp_path), json.dumps(variants))
    for name in ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev"):
        _assert_run_matches(tmp_path / name, references / "dense")
    _assert_run_matches(tmp_path / "single_to_pp2", references / "dense", after=3)  # its 3 resumed steps
    _assert_run_matches(tmp_path / "moe", references / "moe", validation=False)  # its reference evaluates other batches

    # Saved at pp=2 after 3 steps, resumed on one process.
    _resume_copy(tmp_path / "1f1b", tmp_path / "pp2_to_single")
    train(load_config(recipe, [f"train.run_dir={tmp_path}/pp2_to_single"]))
    _assert_run_matches(tmp_path / "pp2_to_single", references / "dense", after=3)

    # The pipelined checkpoint loads whole on one process and generates.
    pipelined, single = load(tmp_path / "1f1b").state_dict(), load(references / "dense").state_dict()
    assert pipelined.keys() == single.keys()
    for name, weight in pipelined.items():
        torch.testing.assert_close(weight, single[name], rtol=1e-4, atol=1e-5, msg=name)
    result = run_cli("generate", str(tmp_path / "1f1b"), "--prompt", "def ", "--max-new-tokens", "8", "--greedy")
    assert result.returncode == 0 and result.stdout.startswith("def "), result.stderr[-2000:]


@pytest.mark.slow
def test_pp2_with_tp2_sp_and_with_fsdp2(recipe, references, tmp_path):
    variants = {
        "pp2_tp2_sp_ac": [*PP2, "parallel.tp=2", "parallel.microbatches=2", "parallel.activation_checkpoint=full"],
        "pp2_fsdp2_ac": [
            "parallel.pp=2",
            "parallel.dp_shard=2",
            "parallel.pp_schedule=interleaved_1f1b",
            "parallel.microbatches=2",
            "parallel.activation_checkpoint=selective",
        ],
    }
    torchrun(4, "tests/helpers/dist_variants.py", str(recipe), str(tmp_path), json.dumps(variants))
    for name in variants:
        _assert_run_matches(tmp_path / name, references / "dense")


@pytest.mark.slow
def test_pp2_tp2_fsdp2_on_eight_processes(recipe, references, tmp_path):
    variants = {
        "pp2_tp2_fsdp2": [
            "parallel.pp=2",
            "parallel.tp=2",
            "parallel.dp_shard=2",
            "parallel.microbatches=2",
            "parallel.activation_checkpoint=op",
        ]
    }
    torchrun(8, "tests/helpers/dist_variants.py", str(recipe), str(tmp_path), json.dumps(variants))
    _assert_run_matches(tmp_path / "pp2_tp2_fsdp2", references / "dense")


@pytest.mark.slow
def test_pipeline_benchmark_runs_both_modes():
    """benchmarks/pipeline.py stays runnable (one tiny step per mode; timings are never asserted)."""
    import os
    import subprocess
    import sys

    from helpers.runs import REPO

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    common = ["--steps", "1", "--pp", "2", "--microbatches", "2"]
    schedules = ["1f1b", "gpipe", "interleaved_1f1b", "interleaved_zb"]
    real = ["--mode", "real", "--dims", "32", "--layers", "4", "--splits", "even,cost"]
    for mode, splits in ((["--mode", "sleep", "--cost-ms", "1"], ["even"]), (real, ["cost", "even"])):
        cmd = [sys.executable, str(REPO / "benchmarks" / "pipeline.py"), *mode, *common]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)
        assert out.returncode == 0, out.stderr[-2000:]
        rows = [line.split(" | ") for line in out.stdout.splitlines() if line.startswith("| ") and "---" not in line]
        assert sorted((row[1], row[2]) for row in rows[1:]) == [(s, k) for s in splits for k in schedules]
