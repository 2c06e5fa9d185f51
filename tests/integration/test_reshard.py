"""Sharded checkpoints resume under another layout with the same losses and grad norms (compared
only on the steps the resumed runs trained) and the same final parameters; consolidation."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tessera.api import load
from tessera.validate import load_config
from tessera.train.trainer import train

from helpers.runs import assert_runs_match, run_cli, torchrun, write_tiny_recipe

BASE = [
    "train.steps=8",
    "train.batch_size=8",
    "log.every=1",
    "optim.schedule=constant",
    "train.eval_every=0",
    "checkpoint.every=4",
    "model.tie_embeddings=false",
]


@pytest.mark.slow
def test_checkpoints_reshard_across_layouts(tmp_path, cache_dir):
    recipe = write_tiny_recipe(tmp_path / "job.toml", cache_dir, *BASE)
    reference = train(load_config(recipe, [f"train.run_dir={tmp_path}/ref"])).run_dir

    # Save at FSDP=4 after 4 of 8 steps.
    torchrun(
        4,
        "tests/helpers/dist_variants.py",
        str(recipe),
        str(tmp_path),
        json.dumps({"fsdp4": ["parallel.dp_shard=4", "train.steps=4"]}),
    )
    assert (tmp_path / "fsdp4" / "checkpoints" / "step_00000004" / "meta.json").is_file()
    for name in ("to_fsdp2_tp2", "to_single"):
        shutil.copytree(tmp_path / "fsdp4", tmp_path / name)
    # The single-process reference's step-4 checkpoint, to resume under HSDP 2x2.
    shutil.copytree(tmp_path / "ref", tmp_path / "single_to_hsdp")
    shutil.rmtree(tmp_path / "single_to_hsdp" / "checkpoints" / "step_00000008")

    variants = {
        "to_fsdp2_tp2": ["parallel.dp_shard=2", "parallel.tp=2"],
        "single_to_hsdp": ["parallel.dp_replicate=2", "parallel.dp_shard=2"],
    }
    torchrun(4, "tests/helpers/dist_variants.py", str(recipe), str(tmp_path), json.dumps(variants))
    train(load_config(recipe, [f"train.run_dir={tmp_path}/to_single"]))

    for name in ("to_fsdp2_tp2", "single_to_hsdp", "to_single"):
        assert assert_runs_match(tmp_path / name, reference, after=4) == 4  # steps 5-8, trained after the resume

    # One safetensors file from the FSDP x TP checkpoint, equal to the single-process weights.
    out = tmp_path / "consolidated"
    result = run_cli("convert", "consolidate", str(tmp_path / "to_fsdp2_tp2"), str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    weights = load_file(str(out / "model.safetensors"))
    single = load(tmp_path / "to_single").state_dict()
    assert set(weights) == set(single)
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, single[name], rtol=1e-4, atol=1e-5)
