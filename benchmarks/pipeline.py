"""Pipeline bubble: measured idle fraction of each schedule next to the theoretical bubble.

    python benchmarks/pipeline.py [--cost-ms 20] [--steps 2]

For p in {2, 4} ranks and m in {4, 8} micro-batches, every tessera pipeline schedule (torch's
GPipe, 1F1B, interleaved 1F1B, interleaved zero-bubble) runs stages whose compute is a fixed
artificial cost per micro-batch (a sleep, so CPU noise and core count do not dominate): forward
F, input-gradient B and weight-gradient W of ``cost`` each, split evenly over a rank's virtual
stages. A rank's idle fraction is 1 - (time in stage compute) / (wall time of the step), the
table shows the mean over ranks. Theory: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) for
interleaved 1F1B with v stages per rank, and the ZB-H1 estimate (p-1)/(3*v*m+p-1) (its bubble
is (p-1)(F+B-W)) for interleaved zero-bubble. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.pipelining import PipelineStage

from tessera.layout import MULTI_STAGE_SCHEDULES as MULTI_STAGE
from tessera.parallel.pipeline import SCHEDULES

_BUSY = [0.0]  # seconds of stage compute in this process


def _spend(seconds: float) -> None:
    time.sleep(seconds)
    _BUSY[0] += seconds


class _InputCost(torch.autograd.Function):
    """Forward and input-gradient cost on the activation path."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        _spend(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        _spend(ctx.seconds)
        return grad, None


class _WeightCost(torch.autograd.Function):
    """Weight-gradient cost: only the parameter path runs it (the W of zero-bubble schedules)."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return w.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        _spend(ctx.seconds)
        return grad, None


class CostStage(nn.Module):
    """A stage that costs ``seconds`` in forward, input backward and weight backward each."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.bias = nn.Parameter(torch.zeros(1))
        self.weight = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` unchanged in value, after the stage's artificial compute."""
        return _InputCost.apply(x + self.bias, self.seconds) + _WeightCost.apply(self.weight, self.seconds)


def theoretical_bubble(schedule: str, p: int, m: int, v: int) -> float:
    """The ideal idle fraction of ``schedule`` (see the module docstring)."""
    if schedule == "interleaved_zb":
        return (p - 1) / (3 * v * m + p - 1)
    return (p - 1) / (v * m + p - 1)


def _measure(rank: int, p: int, schedule: str, m: int, cost: float, steps: int) -> float:
    v = 2 if schedule in MULTI_STAGE else 1
    ids = [rank + k * p for k in range(v)]
    stages = [PipelineStage(CostStage(cost / v), s, p * v, torch.device("cpu")) for s in ids]
    cls = SCHEDULES[schedule]
    sched = cls(stages if v > 1 else stages[0], m, loss_fn=lambda out, target: out.mean(), scale_grads=False)
    x, target = torch.zeros(m, 8), torch.zeros(m, 8)
    idle = []
    for step in range(steps + 1):  # the first step also infers shapes: not timed
        kwargs = {"target": target} if p * v - 1 in ids else {}
        dist.barrier()
        _BUSY[0] = 0.0
        start = time.perf_counter()
        sched.step(*((x,) if 0 in ids else ()), **kwargs)
        wall = time.perf_counter() - start
        if step:
            idle.append(1.0 - _BUSY[0] / wall)
    return sum(idle) / len(idle)


def _worker(rank: int, p: int, port: int, ms: list[int], cost: float, steps: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=p)
    try:
        for schedule in SCHEDULES:
            for m in ms:
                idle = torch.tensor([_measure(rank, p, schedule, m, cost, steps)])
                dist.all_reduce(idle)
                if rank == 0:
                    queue.put((schedule, m, idle.item() / p))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cost-ms", type=float, default=20.0, help="F, B and W cost per micro-batch and rank")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per configuration")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    print("| schedule | p | m | measured idle | theoretical bubble |")
    print("|---|---|---|---|---|")
    for p in (2, 4):
        queue = ctx.Queue()
        mp.spawn(_worker, args=(p, _free_port(), [4, 8], args.cost_ms / 1000, args.steps, queue), nprocs=p)
        while not queue.empty():
            schedule, m, idle = queue.get()
            v = 2 if schedule in MULTI_STAGE else 1
            print(f"| {schedule} | {p} | {m} | {idle:.3f} | {theoretical_bubble(schedule, p, m, v):.3f} |")


if __name__ == "__main__":
    main()
