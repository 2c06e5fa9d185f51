"""Test driver run under torchrun: train variants of one recipe (any engine) in one process group; after
the variants named in NATIVE, also write DeepSpeed's own checkpoint into RUN_DIR/native.

    torchrun --nproc-per-node N tests/dist_deepspeed.py BASE.toml OUT_DIR '{"name": ["k=v", ...]}' '["name"]'
"""

from __future__ import annotations

import json
import sys

import torch
from distexit import run_and_exit

from tessera.validate import load_config
from tessera.train.distributed import teardown_parallel
from tessera.train.trainer import Trainer


def main() -> None:
    torch.set_num_threads(1)
    base, out, variants, native = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
    try:
        for name, overrides in variants.items():
            trainer = Trainer(load_config(base, [*overrides, f"train.run_dir={out}/{name}"]))
            trainer.fit()
            if name in native:
                trainer.engine.model.save_checkpoint(f"{out}/{name}/native")
    finally:
        teardown_parallel()


if __name__ == "__main__":
    run_and_exit(main)
