"""Test driver run under torchrun: train several variants of one recipe in one process group.

    torchrun --nproc-per-node N tests/dist_variants.py BASE.toml OUT_DIR '{"name": ["k=v", ...], ...}'

Starting the processes once and training every variant in them keeps the distributed parity
tests within the CI budget on two cores.
"""

from __future__ import annotations

import json
import sys

import torch
from distexit import run_and_exit

from tessera.validate import load_config
from tessera.train.distributed import teardown_parallel
from tessera.train.trainer import train


def main() -> None:
    torch.set_num_threads(1)
    base, out, variants = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    try:
        for name, overrides in variants.items():
            train(load_config(base, [*overrides, f"train.run_dir={out}/{name}"]))
    finally:
        teardown_parallel()


if __name__ == "__main__":
    run_and_exit(main)
