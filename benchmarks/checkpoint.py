"""Checkpoint stall: synchronous vs asynchronous (``checkpoint.async``) saves of a ~100M-parameter model.

    python benchmarks/checkpoint.py [--ranks 1 4] [--rounds 3] [--steps 2] [--dim 768 --layers 12]

For each world size torchrun starts that many processes (gloo on CPU, NCCL on a GPU) that build
the model the way the trainer does (FSDP over the ranks), take one training step so AdamW has
its state, then save in interleaved rounds with each checkpointer:

- stall: how long the training loop is blocked by a save (sync: the whole ``save()``; async: the
  ``save()`` call plus any wait of the next optimizer step for the staging copy, which runs in
  the background during forward and backward). The target is an async stall of at most 10% of
  the sync save.
- write: from ``save()`` to the renamed, complete checkpoint (async: in the background while
  ``--steps`` training steps run).
- step slowdown: how much longer those overlapped steps took than steps with no write in flight
  (the background writer shares the CPU and the disk).
- load: ``Checkpointer.load`` of model, optimizer and RNG state, i.e. the resume time.

Each figure is the slowest rank's; printed as median [min-max] over rounds, with throughputs in
GB/s of checkpoint bytes. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent


def _config(args: argparse.Namespace):
    from tessera.validate import load_config

    device = "cuda" if torch.cuda.is_available() else "cpu"
    keys = [
        f"model.dim={args.dim}", f"model.n_layers={args.layers}", f"model.n_heads={args.dim // 64}",
        f"model.vocab_size={args.vocab}", "model.tie_embeddings=true", f"model.max_seq_len={args.seq}",
        f"train.seq_len={args.seq}", f"train.batch_size={int(os.environ.get('WORLD_SIZE', '1'))}",
        f"train.device={device}", "optim.warmup_steps=0", "data.tokenizer=unused.model",
    ]  # fmt: skip
    return load_config(None, keys)


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, args, device) -> float:
    """One forward/backward/AdamW step on random tokens; returns its seconds."""
    started = time.perf_counter()
    tokens = torch.randint(0, args.vocab, (1, args.seq + 1), device=device)
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def _one_save(checkpointer, step: int, model, optimizer, args, device, parallel) -> dict[str, float]:
    """Save, run ``args.steps`` steps (overlapping an async write), wait for the checkpoint to be complete."""
    parallel.barrier()
    stalled_before = getattr(checkpointer, "stalled_seconds", 0.0)
    started = time.perf_counter()
    path = checkpointer.save(step, model, optimizer, {"benchmark": True})
    stall = time.perf_counter() - started
    steps = [_train_step(model, optimizer, args, device) for _ in range(args.steps)]
    stall += getattr(checkpointer, "stalled_seconds", 0.0) - stalled_before  # the optimizer step waited for staging
    checkpointer.wait()
    write = checkpointer.write_seconds if hasattr(checkpointer, "write_seconds") else stall
    size = sum(f.stat().st_size for f in path.iterdir())
    return {"stall": stall, "write": write, "step": statistics.mean(steps), "bytes": size}


def _one_load(checkpointer, model, optimizer, parallel) -> float:
    """Seconds to restore model, optimizer and RNG from the run's newest checkpoint (the resume).

    Timed after all saves: a load replaces the optimizer's state tensors, which the async stager
    then allocates again (as the first save after a real resume does)."""
    from tessera.train.checkpoint import latest_checkpoint

    parallel.barrier()
    started = time.perf_counter()
    checkpointer.load(latest_checkpoint(checkpointer.root.parent), model, optimizer)
    return time.perf_counter() - started


def worker(args: argparse.Namespace) -> None:
    """One rank: build, warm up, then alternate sync and async saves for ``args.rounds`` rounds."""
    import torch.distributed as dist

    from tessera.model import build_model
    from tessera.train.async_checkpoint import AsyncCheckpointer
    from tessera.train.checkpoint import Checkpointer
    from tessera.train.distributed import setup_parallel, teardown_parallel

    config = _config(args)
    parallel = setup_parallel(config, torch.device(config.train.device))
    device = parallel.device
    torch.manual_seed(0)
    model = parallel.parallelize(build_model(config.model), config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    _train_step(model, optimizer, args, device)  # AdamW state exists from here on
    base = [_train_step(model, optimizer, args, device) for _ in range(args.steps + 1)][1:]
    root = Path(args.out_dir)
    checkpointers = {
        "sync": Checkpointer(root / "sync", 1, parallel.is_main),
        "async": AsyncCheckpointer(root / "async", 1, parallel.is_main),
    }
    rows = []
    for r in range(args.rounds):
        for mode in ("sync", "async") if r % 2 == 0 else ("async", "sync"):
            rows.append(
                {"mode": mode, **_one_save(checkpointers[mode], r + 1, model, optimizer, args, device, parallel)}
            )
    for row in rows:
        row["load"] = _one_load(checkpointers[row["mode"]], model, optimizer, parallel)
    if dist.is_initialized():  # the slowest rank is what the loop waits for
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, rows)
        rows = [
            {k: max(o[i][k] for o in everyone) if k != "mode" else v for k, v in row.items()}
            for i, row in enumerate(rows)
        ]
    if parallel.is_main:
        n_params = sum(p.numel() for p in model.parameters())  # FSDP: the local shard's count
        world = int(os.environ.get("WORLD_SIZE", "1"))
        print(
            "RESULT "
            + json.dumps({"rows": rows, "base_step": statistics.mean(base), "params_local": n_params, "world": world})
        )
    checkpointers["async"].close()
    teardown_parallel()


def _summary(values: list[float], fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def report(result: dict) -> list[str]:
    """Human lines for one world size."""
    rows, world = result["rows"], result["world"]
    by = {m: [r for r in rows if r["mode"] == m] for m in ("sync", "async")}
    gb = statistics.median(r["bytes"] for r in rows) / 1e9  # the whole checkpoint directory, all ranks' shards
    sync_stall = [r["stall"] for r in by["sync"]]
    async_stall = [r["stall"] for r in by["async"]]
    ratio = [a / s for a, s in zip(async_stall, sync_stall)]
    slowdown = [r["step"] / result["base_step"] - 1 for r in by["async"]]
    lines = [
        (
            f"{world} rank(s), checkpoint {gb:.2f} GB (model, AdamW state, RNG), "
            f"training step {result['base_step']:.2f} s without a write"
        ),
        f"  sync  save (= stall)       {_summary(sync_stall)} s   {gb / statistics.median(sync_stall):.2f} GB/s",
        (
            f"  async stall                {_summary(async_stall)} s   = "
            f"{_summary([100 * x for x in ratio], '{:.1f}')}% "
            "of the sync save (target <= 10%)"
        ),
        f"  async write (background)   {_summary([r['write'] for r in by['async']])} s",
        f"  step slowdown during write {_summary([100 * x for x in slowdown], '{:.0f}')}%",
        (
            f"  load (resume)              {_summary([r['load'] for r in rows])} s   "
            f"{gb / statistics.median(r['load'] for r in rows):.2f} GB/s"
        ),
    ]
    return lines


def main() -> None:
    """Run the worker under torchrun for each world size and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="training steps per save (overlapping an async write)")
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="torch threads per rank (0 = cores / ranks)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    cores = os.cpu_count() or 1
    for ranks in args.ranks:
        with tempfile.TemporaryDirectory(dir=os.environ.get("TESSERA_BENCH_DIR")) as tmp:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
            cmd += [__file__, "--worker", "--out-dir", tmp] + sys.argv[1:]
            threads = args.threads or max(1, cores // ranks)
            env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO)}
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
            found = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
            if not found:
                print(f"{ranks} rank(s) failed:\n{out.stderr[-3000:]}")
                continue
            print("\n".join(report(json.loads(found[0][len("RESULT ") :]))), flush=True)


if __name__ == "__main__":
    main()
