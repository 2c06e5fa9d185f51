"""Peak memory per rank of ``train.init_from`` from an HF directory: 4 ranks (FSDP2, gloo), an 8-layer Llama.

    python benchmarks/init_from_memory.py [--dim 512] [--layers 8] [--ranks 4]

Each rank builds the model on the meta device, shards it with FSDP2 (``fully_shard`` per block and the root),
materializes its shards, then loads the HF weights with :meth:`InitSource.load_into` (safetensors slices: only
the rows each rank owns). Reported per rank: the growth of peak RSS during the load (which includes
writing the rank's own shard: ``to_empty`` leaves its pages untouched) (VmHWM after the load minus VmRSS
before, the peak reset with ``/proc/self/clear_refs``: the fixed overhead of the process, torch and the sharded model is measured before and subtracted),
next to the model's full fp32 bytes, the rank's shard and the largest single tensor. The peer, measured the same
way in the same run: every rank reading the whole checkpoint first (``read_hf``, what a full-state load does).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MIB = 2**20


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> float:
    """Reset the peak RSS (VmHWM) to the current RSS (Linux ``clear_refs`` 5); returns the current RSS."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_mib("VmRSS")


def save_source(path: Path, dim: int, layers: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=8192,
        hidden_size=dim,
        intermediate_size=dim * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(cfg).save_pretrained(str(path))


def _worker(rank: int, world: int, hf: str, mode: str, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tessera.model import build_model
    from tessera.hf.weights import read_hf
    from tessera.train.init_from import open_source

    source = open_source(hf, None)
    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        model = build_model(source.cfg)
    blocks = model.layers.values() if isinstance(model.layers, torch.nn.ModuleDict) else model.layers
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    dist.barrier()
    gc.collect()
    before = _reset_peak()
    if mode == "sliced":
        source.load_into(model)
    else:
        _, state, _ = read_hf(hf)  # the whole checkpoint in this rank's memory (copied, as a full load does)
        state = {k: v.clone() for k, v in state.items()}
        source.load_into(model)
        del state
    after = _status_mib("VmHWM")
    out[(mode, rank)] = after - before
    dist.barrier()
    dist.destroy_process_group()


def measure(hf: Path, mode: str, world: int, port: int) -> list[float]:
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(world, str(hf), mode, port, out), nprocs=world)
        return [out[(mode, r)] for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    from safetensors import safe_open

    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / "hf"
        save_source(hf, args.dim, args.layers)
        with safe_open(str(hf / "model.safetensors"), framework="pt") as f:
            sizes = [f.get_slice(k).get_shape() for k in f.keys()]  # noqa: SIM118
        numel = [int(torch.Size(s).numel()) for s in sizes]
        full, largest = sum(numel) * 4 / MIB, max(numel) * 4 / MIB
        rounds = {"sliced": [], "full": []}
        for i in range(args.rounds):  # interleaved: the machine's load hits both alike
            for j, (mode, values) in enumerate(rounds.items()):
                values += measure(hf, mode, args.ranks, 29600 + 10 * i + j)
    print(f"model {full:.1f} MiB fp32; shard per rank {full / args.ranks:.1f} MiB; largest tensor {largest:.1f} MiB")
    print(f"target per rank: shard + largest = {full / args.ranks + largest:.1f} MiB (+ fixed overhead, subtracted)")
    for mode, values in rounds.items():
        print(
            f"{mode:>6}: peak RSS growth per rank, MiB: median {statistics.median(values):.1f}, "
            f"min {min(values):.1f}, max {max(values):.1f} ({len(values)} rank-loads, {args.rounds} rounds)"
        )
    print("(measured on a shared, loaded 2-core machine; RSS growth, not timing, so load barely matters)")


if __name__ == "__main__":
    sys.exit(main())
