"""ZeRO-2, per-block compile, fused = for-loop AdamW, meta-device init under FSDP; offload's CPU error; compat table."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tessera.api import load
from tessera.config import ConfigError
from tessera.validate import load_config
from tessera.compat import render_markdown
from tessera.train.distributed import setup_parallel
from tessera.model import build_model
from tessera.train.trainer import train

from helpers.runs import REPO, assert_runs_match, step_losses, torchrun, write_tiny_recipe

BASE = ["train.steps=5", "train.batch_size=8", "log.every=1", "optim.schedule=constant", "train.eval_every=0"]


ZERO2 = ["parallel.dp_shard=2", "parallel.reshard_after_forward=false"]
MOE = ["model.moe.experts=4", "model.moe.top_k=2", "model.moe.z_loss_coef=0.001", "model.moe.aux_loss_scope=micro"]


@pytest.mark.slow
def test_zero2_compile_and_meta_init_under_fsdp(tmp_path, cache_dir):
    recipe = write_tiny_recipe(tmp_path / "job.toml", cache_dir, *BASE)
    reference = train(load_config(recipe, [f"train.run_dir={tmp_path}/ref"])).run_dir
    # MoE's aux loss is per rank: its reference accumulates the two ranks' halves of the batch.
    moe_reference = train(
        load_config(recipe, [*MOE, "train.batch_size=4", "train.grad_accum=2", f"train.run_dir={tmp_path}/moe_ref"])
    ).run_dir
    variants = {
        "zero2": ZERO2,
        "compiled": ["parallel.dp_shard=2", "parallel.compile=true"],
        # zero2 and the others step with fused AdamW (optim.implementation=auto) on DTensors; this is zero2 for-loop.
        "forloop_adamw": [*ZERO2, "optim.implementation=for-loop"],
        "compiled_moe": ["parallel.dp_shard=2", "parallel.compile=true", *MOE],
        "meta": ["parallel.dp_shard=2", "parallel.meta_init=true"],
        # lr ~ 0: the weights stay at their initial values, to check every tensor's init statistics.
        "meta_frozen": ["parallel.dp_shard=2", "parallel.meta_init=true", "optim.lr=1e-12", "model.n_layers=4"],
    }
    torchrun(2, "tests/helpers/dist_variants.py", str(recipe), str(tmp_path), json.dumps(variants))
    assert_runs_match(tmp_path / "zero2", reference)
    assert_runs_match(tmp_path / "compiled", reference)
    assert_runs_match(tmp_path / "forloop_adamw", tmp_path / "zero2", rtol=1e-6)
    assert_runs_match(tmp_path / "compiled_moe", moe_reference)
    meta = step_losses(tmp_path / "meta")
    # Initialized after sharding (other random draws), so only "it trains" can be required of the curve.
    assert meta != step_losses(reference) and meta[-1] < meta[0]
    frozen = load(tmp_path / "meta_frozen")
    _assert_init_statistics_match(frozen, load_config(recipe, ["model.n_layers=4"]))
    for name, param in frozen.named_parameters():  # each rank drew its own shard, not a copy of the other's
        if param.dim() == 2 and param.std() > 0:
            half = param.shape[0] // 2
            assert not torch.allclose(param[:half], param[half : 2 * half]), f"{name}: the two shards are copies"


def _assert_init_statistics_match(model: torch.nn.Module, config) -> None:
    """Every tensor of a meta-initialized model has the mean and std of the same tensor initialized
    the ordinary way (normal(0, 0.02), residual projections 0.02/sqrt(2 n_layers), norms 1, biases 0)."""
    torch.manual_seed(0)
    expected = dict(build_model(config.model).named_parameters())
    got = dict(model.named_parameters())
    assert got.keys() == expected.keys()
    for name, want in expected.items():
        have = got[name].detach()
        if want.std() == 0:  # constant init (norm weights, biases): exactly that constant
            assert torch.equal(have, want.detach()), name
            continue
        assert abs(have.std() / want.std() - 1) < 0.08, f"{name}: std {have.std():.5f} vs {want.std():.5f}"
        assert abs(have.mean()) < 4 * want.std() / have.numel() ** 0.5, f"{name}: mean {have.mean():.5f}"
    out_std = config.model.init_std / (2 * config.model.n_layers) ** 0.5
    assert abs(got["layers.1.attention.o_proj.weight"].std() / out_std - 1) < 0.08  # the scaled residual init


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


def test_docs_compatibility_table_is_the_declared_one():
    page = (REPO / "docs" / "parallelism" / "index.md").read_text()
    block = re.search(r"<!-- compat:start -->\n(.*?)\n<!-- compat:end -->", page, re.S)
    assert block, "docs/parallelism/index.md lost its compatibility table markers"
    assert block.group(1).strip() == render_markdown().strip()
