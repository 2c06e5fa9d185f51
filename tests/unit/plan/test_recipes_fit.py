"""Every full-size recipe names the cluster it is for, and the planner predicts it fits there."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from tessera.plan import GIB, gpu
from tessera.plan.planner import requested_estimate
from tessera.plan.shapes import model_shape
from tessera.validate import load_config

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
FULL_SIZE = sorted(p.stem for p in CONFIGS.glob("*.toml") if p.stem != "smoke")  # smoke.toml is the CPU job
TARGET = re.compile(r"^# target: (\d+) x ([\w-]+)[ :]", re.M)


def target_of(name: str) -> tuple[int, str]:
    """The ``# target: N x KIND`` line of a recipe's header."""
    match = TARGET.search((CONFIGS / f"{name}.toml").read_text())
    assert match, f"configs/{name}.toml has no '# target: N x GPU-KIND' line in its header"
    return int(match.group(1)), match.group(2)


@pytest.mark.parametrize("name", FULL_SIZE)
def test_recipe_fits_the_cluster_its_header_names(name):
    """The recipe's own layout (degrees, micro-batch, checkpointing) is predicted to fit its target's memory."""
    world, kind = target_of(name)
    config = load_config(CONFIGS / f"{name}.toml")
    est = requested_estimate(config, model_shape(config.model), world, dataclasses.replace(gpu(kind), gpus_per_node=8))
    assert est is not None, f"{name}: the planner does not accept the recipe's layout on {world} GPUs"
    assert est.fits, f"{name}: {est.memory.total / GIB:.1f} GiB per GPU, over {gpu(kind).memory / GIB:.1f}"


def test_the_fit_check_notices_an_oversized_micro_batch():
    """The check can fail: the 8B recipe with its whole batch in one micro-batch does not fit its 8 GPUs."""
    world, kind = target_of("llama3-8b")
    config = load_config(CONFIGS / "llama3-8b.toml", ["train.batch_size=512", "train.grad_accum=1"])
    est = requested_estimate(config, model_shape(config.model), world, gpu(kind))
    assert est is not None and not est.fits


def test_the_fit_check_refuses_a_batch_the_data_parallel_ranks_cannot_split():
    """A global batch of 3 over llama3-8b's 4 data-parallel ranks is refused (None), not estimated as 4."""
    world, kind = target_of("llama3-8b")
    config = load_config(CONFIGS / "llama3-8b.toml", ["train.batch_size=3", "train.grad_accum=1"])
    assert requested_estimate(config, model_shape(config.model), world, gpu(kind)) is None
