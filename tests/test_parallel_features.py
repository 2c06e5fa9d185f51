"""ZeRO-2, per-block compile and meta-device init under FSDP; offload's CPU error; compat table."""

from __future__ import annotations

import json
import re

import pytest

from tessera.api import load
from tessera.config import ConfigError, load_config
from tessera.compat import render_markdown
from tessera.train.distributed import setup_parallel
from tessera.train.trainer import train

from conftest import REPO, assert_losses_close, step_losses, torchrun, write_tiny_recipe

BASE = ["train.steps=5", "train.batch_size=8", "log.every=1", "optim.schedule=constant", "train.eval_every=0"]


@pytest.mark.slow
def test_zero2_compile_and_meta_init_under_fsdp(tmp_path, cache_dir):
    recipe = write_tiny_recipe(tmp_path / "job.toml", cache_dir, *BASE)
    reference = step_losses(train(load_config(recipe, [f"train.run_dir={tmp_path}/ref"])).run_dir)
    variants = {
        "zero2": ["parallel.dp_shard=2", "parallel.reshard_after_forward=false"],
        "compiled": ["parallel.dp_shard=2", "parallel.compile=true"],
        "meta": ["parallel.dp_shard=2", "parallel.meta_init=true"],
    }
    torchrun(2, "tests/dist_variants.py", str(recipe), str(tmp_path), json.dumps(variants))
    assert_losses_close(step_losses(tmp_path / "zero2"), reference)
    assert_losses_close(step_losses(tmp_path / "compiled"), reference)
    meta = step_losses(tmp_path / "meta")
    # Initialized after sharding (other random draws), so only "it trains" can be required.
    assert meta != reference and meta[-1] < meta[0]
    model = load(tmp_path / "meta")
    std = model.layers["0"].attention.q_proj.weight.std().item()
    assert 0.015 < std < 0.025  # init_std 0.02, not the garbage of uninitialized memory


def test_cpu_offload_on_a_cpu_run_is_a_clear_error(tiny_config):
    import torch

    with pytest.raises(ConfigError, match="a CPU run has nothing to offload"):
        setup_parallel(tiny_config("parallel.dp_shard=2", "parallel.cpu_offload=true"), torch.device("cpu"))


def test_world_size_must_match_the_degrees(tiny_config):
    from tessera.parallel.dims import ParallelDims

    config = tiny_config("parallel.dp_shard=2", "parallel.tp=2")
    with pytest.raises(ConfigError, match=r"= 4, but 2 process\(es\) were launched"):
        ParallelDims.from_config(config.parallel, 2)
    assert ParallelDims.from_config(tiny_config("parallel.tp=2").parallel, 8).dp_shard == 4


def test_readme_compatibility_table_is_the_declared_one():
    readme = (REPO / "README.md").read_text()
    block = re.search(r"<!-- compat:start -->\n(.*?)\n<!-- compat:end -->", readme, re.S)
    assert block, "README.md lost its compatibility table markers"
    assert block.group(1).strip() == render_markdown().strip()
