"""Test driver run under torchrun: train several (recipe, overrides) jobs in one process group.

    torchrun --nproc-per-node N tests/helpers/dist_init_from.py OUT_DIR '{"name": ["RECIPE.toml", "k=v", ...], ...}'

Like dist_variants.py, but each job names its own recipe (init_from sources need matching [model] sections).
"""

from __future__ import annotations

import json
import sys

import torch
from distexit import run_and_exit

from tessera.train.distributed import teardown_parallel
from tessera.train.trainer import train
from tessera.validate import load_config


def main() -> None:
    torch.set_num_threads(1)
    out, jobs = sys.argv[1], json.loads(sys.argv[2])
    try:
        for name, (recipe, *overrides) in jobs.items():
            train(load_config(recipe, [*overrides, f"train.run_dir={out}/{name}"]))
    finally:
        teardown_parallel()


if __name__ == "__main__":
    run_and_exit(main)
