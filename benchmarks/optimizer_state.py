"""Optimizer state bytes and step time: AdamW and Muon, with fp32 or bf16 state (``optim.state_dtype``).

Builds one decoder, gives it gradients, and for each optimizer and state precision counts the
bytes held in the optimizer's state after a step (exact: the sum of the state tensors' sizes), per
parameter and as a ratio to torch.optim.AdamW's fp32 state, the peer. Step time is the median of
interleaved rounds (each configuration once per round), with its spread, in wall-clock and in the
process's CPU time (the fairer figure on a machine shared with other work). Under FSDP every rank
holds 1/N of the same state.

    python benchmarks/optimizer_state.py [--dim 384 --layers 6 --vocab 8192 --rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tessera.config import OptimConfig, model_config
from tessera.model import build_model, count_parameters
from tessera.train.optim import build_optimizer

CONFIGS = [("adamw", "fp32"), ("adamw", "bf16"), ("muon", "fp32"), ("muon", "bf16")]


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer's state."""
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    cfg = model_config(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=6, tie_embeddings=False)
    torch.manual_seed(0)
    model = build_model(cfg)
    n = count_parameters(model)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizers = {c: build_optimizer(model, OptimConfig(name=c[0], state_dtype=c[1], lr=1e-9)) for c in CONFIGS}
    times: dict[tuple[str, str], list[float]] = {c: [] for c in CONFIGS}
    cpu_times: dict[tuple[str, str], list[float]] = {c: [] for c in CONFIGS}
    for _ in range(args.rounds):
        for c, opt in optimizers.items():
            start, cpu_start = time.perf_counter(), time.process_time()
            opt.step()
            times[c].append(time.perf_counter() - start)
            cpu_times[c].append(time.process_time() - cpu_start)
    peer = state_bytes(optimizers["adamw", "fp32"])
    print(
        f"decoder: {n / 1e6:.1f}M parameters (dim {args.dim}, {args.layers} layers, vocab {args.vocab}), "
        f"{torch.get_num_threads()} threads"
    )
    print(
        f"{'optimizer':<8} {'state':<5} {'state MiB':>10} {'bytes/param':>12} {'vs AdamW fp32':>14} "
        f"{'step ms (median, spread)':>26} {'CPU ms (median, spread)':>25}"
    )
    for (name, dtype), opt in optimizers.items():
        size = state_bytes(opt)
        print(
            f"{name:<8} {dtype:<5} {size / 2**20:>10.1f} {size / n:>12.2f} {size / peer:>14.2f} "
            f"{_median_spread(times[name, dtype]):>26} {_median_spread(cpu_times[name, dtype]):>25}"
        )


def _median_spread(seconds: list[float]) -> str:
    """``median (min-max)`` in milliseconds."""
    ms = [t * 1e3 for t in seconds]
    return f"{statistics.median(ms):.0f} ({min(ms):.0f}-{max(ms):.0f})"


if __name__ == "__main__":
    main()
