"""Per-rank memory of data-parallel layouts and TP collectives per block, next to the theory.

Part 1 trains one step of the same decoder (bf16 compute, fp32 master weights, AdamW) under
DDP, ZeRO-2-style FSDP (``reshard_after_forward = false``) and ZeRO-3 FSDP at 1, 2 and 4
ranks, and counts on rank 0 the bytes of parameters, gradients and optimizer state each rank
holds at rest after the optimizer step. The ZeRO paper's
mixed-precision Adam formulas (16P, 4P + 12P/N, 2P + 14P/N, 16P/N bytes for P parameters on N
ranks) are printed beside them.

Part 2 counts the collectives DTensor issues for one tensor-parallel block (tp=2), forward and
backward, with and without sequence parallelism, next to the expected two all-reduces each
way (or their all-gather / reduce-scatter pairs under SP), and their message size.

    python benchmarks/memory.py          # launches torchrun itself for each layout
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

DIM, LAYERS, HEADS, VOCAB, SEQ, BATCH = 256, 4, 8, 4096, 64, 4


def _config(mode: str, world: int):
    from tessera.config import load_config

    parallel = {"ddp": ["parallel.dp_replicate", "parallel.dp_shard=1"], "zero2": ["parallel.dp_shard"], "zero3": ["parallel.dp_shard"]}[mode]
    degree = [parallel[0] + f"={world}", *parallel[1:]] if world > 1 else ["parallel.dp_shard=1"]
    extra = ["parallel.reshard_after_forward=false"] if mode == "zero2" else []
    return load_config(None, [
        f"model.dim={DIM}", f"model.n_layers={LAYERS}", f"model.n_heads={HEADS}", f"model.vocab_size={VOCAB}", "model.max_seq_len=128",
        "model.tie_embeddings=false", f"train.seq_len={SEQ}", f"train.batch_size={BATCH * world}", "train.dtype=bf16", *degree, *extra,
    ])


def _local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def worker(mode: str) -> None:
    """One rank: build, parallelize, one step; rank 0 prints a JSON line of byte counts."""
    import torch.distributed as dist

    from tessera.model import build_model, count_parameters
    from tessera.parallel import ParallelDims, parallelize
    from tessera.parallel.env import init_distributed

    env = init_distributed("cpu")
    config = _config(mode, env.world_size)
    dims = ParallelDims.from_config(config.parallel, env.world_size)
    if env.is_distributed:
        dims.build_mesh("cpu")
    torch.manual_seed(0)
    model = build_model(config.model)
    n_params = count_parameters(model)
    model = parallelize(model, dims, config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if not dims.dp_shard > 1 else torch.autocast("cpu", enabled=False)
    with autocast:
        logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
    opt.step()
    record = {
        "mode": mode, "world": env.world_size, "P": n_params,
        "params": _local_bytes(model.parameters()),
        "grads": _local_bytes(p.grad for p in model.parameters() if p.grad is not None),
        "optim": _local_bytes(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0),
    }
    if env.rank == 0:
        print("RESULT " + json.dumps(record), flush=True)
    if env.is_distributed:
        dist.destroy_process_group()


def tp_worker() -> None:
    """Count DTensor collectives of one TP block, forward and backward, without and with SP."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from tessera.config import model_config
    from tessera.model import build_model
    from tessera.parallel.comms import CollectiveCounter
    from tessera.parallel.tensor import apply_tensor_parallel

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    out = {}
    for sp in (False, True):
        torch.manual_seed(0)
        model = build_model(model_config(vocab_size=VOCAB, dim=DIM, n_layers=1, n_heads=HEADS, max_seq_len=128, tie_embeddings=False))
        apply_tensor_parallel(model, mesh, sp)
        block = model.layers["0"]
        x = torch.randn(BATCH, SEQ, DIM, requires_grad=True)
        if sp:
            from torch.distributed.tensor import DTensor, Shard

            x_in = DTensor.from_local(x.chunk(2, dim=1)[dist.get_rank()].detach().requires_grad_(), mesh, (Shard(1),))
        else:
            x_in = x
        ctx = model.context(BATCH, SEQ, 0, None, None, x.device) if hasattr(model, "context") else None
        fwd, bwd = CollectiveCounter(), CollectiveCounter()
        with fwd:
            y = block(x_in, ctx)
        loss = (y.full_tensor() if hasattr(y, "full_tensor") else y).float().pow(2).mean()
        with bwd:
            loss.backward()
        out["sp" if sp else "tp"] = {
            "forward": {k: f"{v} x {fwd.kib[k]:.0f} KiB" for k, v in fwd.counts.items()},
            "backward": {k: f"{v} x {bwd.kib[k]:.0f} KiB" for k, v in bwd.counts.items()},
        }
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


def _launch(world: int, *args: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if world == 1:
        cmd = [sys.executable, __file__, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", __file__, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{' '.join(args)} at {world} ranks failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[0][7:])


def _theory(mode: str, p: int, n: int) -> float:
    return {"ddp": 16 * p, "zero1": 4 * p + 12 * p / n, "zero2": 2 * p + 14 * p / n, "zero3": 16 * p / n}[mode]


def main() -> None:
    """Run every layout and print both tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", choices=["ddp", "zero2", "zero3"])
    parser.add_argument("--tp-worker", action="store_true")
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker)
    if args.tp_worker:
        return tp_worker()
    mib = 2**20
    print(f"model: dim={DIM} layers={LAYERS} vocab={VOCAB}; bf16 compute, fp32 master weights, AdamW")
    print(f"{'layout':<7}{'ranks':>6}{'params MiB':>12}{'grads MiB':>11}{'optim MiB':>11}{'total MiB':>11}{'theory MiB':>12}")
    for mode in ("ddp", "zero2", "zero3"):
        for world in (1, 2, 4):
            r = _launch(world, "--worker", mode)
            total = r["params"] + r["grads"] + r["optim"]
            theory = _theory(mode if world > 1 else "ddp", r["P"], world)
            print(f"{mode:<7}{world:>6}{r['params'] / mib:>12.2f}{r['grads'] / mib:>11.2f}{r['optim'] / mib:>11.2f}{total / mib:>11.2f}{theory / mib:>12.2f}")
    print("theory: DDP 16P, ZeRO-1 4P+12P/N, ZeRO-2 2P+14P/N, ZeRO-3 16P/N bytes (P parameters, N ranks)")
    print("FSDP2 keeps fp32 master weights sharded at rest in both modes; ZeRO-2-style differs by holding")
    print("the gathered parameters from forward to backward (transient), hence at-rest bytes below 2P+14P/N")
    counts = _launch(2, "--tp-worker")
    size = BATCH * SEQ * DIM * 4 / 1024
    print(f"\ncollectives of one TP block at tp=2 (activation {BATCH}x{SEQ}x{DIM} fp32 = {size:.0f} KiB per collective)")
    for name, expected in (("tp", "2 all_reduce forward, 2 backward"), ("sp", "2 all_gather + 2 reduce_scatter forward, the same backward")):
        print(f"  {name}: measured forward {counts[name]['forward']}, backward {counts[name]['backward']}; expected {expected}")


if __name__ == "__main__":
    main()
