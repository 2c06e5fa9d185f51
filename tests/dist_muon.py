"""Test driver run under torchrun: the sharded Newton-Schulz on hand-made DTensors, then training variants.

    torchrun --nproc-per-node N tests/dist_muon.py BASE.toml OUT_DIR '{"name": ["k=v", ...], ...}'

First every placement Muon meets (FSDP's Shard(0), TP's Shard(0)/Shard(1), HSDP's Replicate x
Shard, FSDP x TP's _StridedShard, uneven and empty shards, expert stacks) is orthogonalized in
one call and compared bitwise with the Newton-Schulz of the whole matrix; then each variant is
trained like tests/dist_variants.py does.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from distexit import run_and_exit
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from tessera.validate import load_config
from tessera.parallel.muon import _plan, newton_schulz, orthogonalize, shard_indices
from tessera.train.distributed import teardown_parallel
from tessera.train.trainer import train

SHAPES = [(13, 6), (5, 7), (64, 32), (3, 64), (24, 40)]


def _cases(world: int) -> list[tuple]:
    """(mesh, placements) pairs for this world size."""
    flat = init_device_mesh("cpu", (world,), mesh_dim_names=("flat",))
    cases = [(flat, (Shard(0),)), (flat, (Shard(1),))]
    if world == 4:
        grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("outer", "inner"))
        cases += [
            (grid, (Shard(0), Shard(1))),
            (grid, (Replicate(), Shard(0))),
            (grid, (Shard(1), Shard(1))),
            (grid, (_StridedShard(0, split_factor=2), Shard(0))),
        ]
    return cases


def check_orthogonalize() -> None:
    """Sharded updates give, bitwise, the shards of the whole matrices' Newton-Schulz; every rank owns some."""
    world, gen = dist.get_world_size(), torch.Generator().manual_seed(0)
    fulls, tensors = [], []
    for mesh, placements in _cases(world):
        for shape in SHAPES:
            full = torch.randn(shape, generator=gen)
            index = shard_indices(shape, tuple(mesh.shape), tuple(mesh.get_coordinate()), placements)
            local = full[index[0][:, None], index[1][None, :]]
            tensor = DTensor.from_local(local, mesh, placements, shape=full.shape, stride=full.stride())
            assert torch.equal(tensor.full_tensor(), full), f"layout of {placements} {shape} differs from DTensor's"
            fulls.append(full)
            tensors.append(tensor)
    stack = torch.randn(3, 8, 6, generator=gen)  # experts sharded along dim 0 (one rank gets none): no communication
    mine = shard_indices(tuple(stack.shape), (world,), (dist.get_rank(),), (Shard(0),))[0]
    experts = DTensor.from_local(stack[mine], *_cases(world)[0], shape=stack.shape, stride=stack.stride())
    results = orthogonalize([*tensors, experts], 5, torch.float32)
    for tensor, full, result in zip(tensors, fulls, results):
        got = DTensor.from_local(result, tensor.device_mesh, tensor.placements, shape=full.shape, stride=full.stride())
        assert torch.equal(got.full_tensor(), newton_schulz(full, 5, torch.float32)), tensor.placements
    whole = DTensor.from_local(results[-1], *_cases(world)[0], shape=stack.shape, stride=stack.stride()).full_tensor()
    assert torch.equal(whole, newton_schulz(stack, 5, torch.float32))  # each expert alone: see test_muon.py
    mesh = _cases(world)[0][0]
    owners = {u.owner for u in _plan(mesh, tuple((tuple(t.shape), tuple(t.placements)) for t in tensors[:10]))}
    assert owners == set(range(world)), owners


def main() -> None:
    torch.set_num_threads(1)
    base, out, variants = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    dist.init_process_group("gloo")
    try:
        check_orthogonalize()
        for name, overrides in variants.items():
            train(load_config(base, [*overrides, f"train.run_dir={out}/{name}"]))
    finally:
        teardown_parallel()


if __name__ == "__main__":
    run_and_exit(main)
