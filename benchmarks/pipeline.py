"""Pipeline bubble: measured idle fraction of each schedule next to the theoretical bubble.

    python benchmarks/pipeline.py --mode sleep [--cost-ms 5,20,80] [--steps 2]
    python benchmarks/pipeline.py --mode real [--dims 64,256,512] [--steps 2]

For p ranks (``--pp``, default 2 and 4) and m micro-batches (``--microbatches``, default 4 and 8),
every tessera pipeline schedule (torch's GPipe, 1F1B, interleaved 1F1B, interleaved zero-bubble)
runs one of two kinds of stages:

- ``sleep``: stages whose compute is a fixed artificial cost per micro-batch (a sleep, so CPU noise
  and core count do not dominate): forward F, input-gradient B and weight-gradient W of ``cost``
  each, split evenly over a rank's virtual stages. Busy time is the time asleep.
- ``real``: tessera's own pipeline (``tessera.parallel.pipeline.build_pipeline``, the split,
  stage hooks, fused head + loss on the last stage and schedule ``tessera train`` uses with ``parallel.pp``) of a Llama-shaped
  decoder of ``--layers`` blocks at each width of ``--dims``, one process per rank, one thread
  each. Busy time is the time inside the stages' forward, backward and weight-backward actions
  (model compute and the loss); sends, receives and the schedule's own bookkeeping count as idle.

A rank's idle fraction is 1 - busy / (wall time of the step on the slowest rank); the table shows
the mean over ranks, and the stage's cost: busy milliseconds per micro-batch and stage (F + B + W). Theory:
(p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) for interleaved 1F1B with v stages per rank,
and the ZB-H1 estimate (p-1)/(3*v*m+p-1) (its bubble is (p-1)(F+B-W)) for interleaved
zero-bubble. "x theory" is measured / theory (1.10 = within 10%). Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.pipelining import PipelineStage

from tessera.config import JobConfig
from tessera.validate import load_config
from tessera.layout import MULTI_STAGE_SCHEDULES as MULTI_STAGE
from tessera.layout import V_SCHEDULES, local_stage_ids
from tessera.parallel.pipeline import SCHEDULES

_BUSY = [0.0]  # seconds of stage compute in this process
RECIPE = Path(__file__).resolve().parent.parent / "configs" / "tiny" / "llama.toml"
_ACTIONS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


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


def _virtual(schedule: str) -> int:
    return 2 if schedule in MULTI_STAGE else 1


def _timed_steps(step, steps: int) -> tuple[float, float]:
    """(mean idle fraction, mean step seconds) of ``steps`` calls of ``step`` after one untimed call (shape inference).

    The step's wall time is the slowest rank's: a rank whose part ends early (the last stage of 1F1B)
    is idle until the step ends on every rank, as the theoretical bubble counts it.
    """
    idle, walls = [], []
    for i in range(steps + 1):
        dist.barrier()
        _BUSY[0] = 0.0
        start = time.perf_counter()
        step()
        wall = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)
        if i:
            idle.append(1.0 - _BUSY[0] / wall.item())
            walls.append(wall.item())
    return sum(idle) / len(idle), sum(walls) / len(walls)


def _measure_sleep(rank: int, p: int, schedule: str, m: int, cost: float, steps: int) -> tuple[float, float, float]:
    """(idle fraction, busy ms per micro-batch and stage, step s) of sleep stages costing ``cost`` s per F, B and W."""
    v = _virtual(schedule)
    ids = local_stage_ids(rank, p, v, schedule)
    stages = [PipelineStage(CostStage(cost / v), s, p * v, torch.device("cpu")) for s in ids]
    cls = SCHEDULES[schedule]
    sched = cls(stages if v > 1 else stages[0], m, loss_fn=lambda out, target: out.mean(), scale_grads=False)
    x, target = torch.zeros(m, 8), torch.zeros(m, 8)
    kwargs = {"target": target} if p * v - 1 in ids else {}
    idle, wall = _timed_steps(lambda: sched.step(*((x,) if 0 in ids else ()), **kwargs), steps)
    return idle, 3 * cost / v * 1000, wall


def _timed_action(method):
    """``method`` (a stage action) adding its wall time to the process's busy seconds."""

    @functools.wraps(method)
    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            _BUSY[0] += time.perf_counter() - start

    return run


def _real_config(p: int, schedule: str, m: int, dim: int, layers: int, split: str, vocab: int) -> JobConfig:
    """The tiny Llama decoder at width ``dim`` split over ``p`` ranks with ``schedule`` and ``m`` micro-batches
    (``split``: "even" block counts or "cost", ``parallel.layers_per_stage``)."""
    return load_config(
        RECIPE,
        [
            f"model.dim={dim}",
            f"model.n_layers={layers}",
            f"model.n_heads={max(dim // 32, 2)}",
            f"model.n_kv_heads={max(dim // 64, 1)}",
            f"parallel.pp={p}",
            f"parallel.pp_schedule={schedule}",
            f"parallel.microbatches={m}",
            f"train.batch_size={2 * m}",
            f"parallel.layers_per_stage={'' if split == 'even' else split}",
            *([f"model.vocab_size={vocab}"] if vocab else []),
        ],
    )


def _measure_real(rank: int, dims, schedule: str, m: int, dim: int, args: argparse.Namespace, split: str):
    """(idle fraction, busy ms per micro-batch and stage, step s) of tessera's pipeline of the decoder at ``dim``."""
    from tessera.model import build_model
    from tessera.parallel import parallelize
    from tessera.parallel.loss import MicroBatch
    from tessera.parallel.pipeline import build_pipeline
    from tessera.train.loss import FusedHeadLoss, lm_loss

    p = dims.pp
    cfg = _real_config(p, schedule, m, dim, args.layers, split, args.vocab)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    chunk = cfg.train.loss_chunk_tokens  # the last stage fuses the head into the loss, as the trainer does
    head_loss = lambda labels, mask, smoothing, twice: FusedHeadLoss(labels, mask, smoothing, chunk, twice)
    stage = lambda s: parallelize(s, dims, cfg)
    pipe = build_pipeline(model, dims, cfg, torch.device("cpu"), lm_loss, stage, head_loss)
    stages = pipe.schedule._stages if schedule in MULTI_STAGE else [pipe.schedule._stage]
    for stage in stages:
        for name in _ACTIONS:
            setattr(stage, name, _timed_action(getattr(stage, name)))
    pipe.schedule._loss_fn = _timed_action(pipe.schedule._loss_fn)  # the loss is the last stage's compute too
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    batch = MicroBatch((inputs,), {}, labels)
    idle, wall = _timed_steps(lambda: pipe.step(batch, 1), args.steps)
    busy_ms = _BUSY[0] * 1000 / (m * len(stages))  # the last timed step's
    return idle, busy_ms, wall


def _rounds(rank: int, p: int, dims, schedule: str, m: int, cost: float, args) -> dict[str, tuple]:
    """Interleaved rounds (A B A B ...) of each stage split: per split (idle, busy ms, step ms median, min, max),
    idle and busy as medians of the rank means."""
    runs: dict[str, list[tuple[float, float, float]]] = {split: [] for split in args.splits}
    for _ in range(args.rounds):
        for split in args.splits:
            if args.mode == "real":
                idle, busy, wall = _measure_real(rank, dims, schedule, m, int(cost), args, split)
            else:
                idle, busy, wall = _measure_sleep(rank, p, schedule, m, cost / 1000, args.steps)
            figures = torch.tensor([idle, busy], dtype=torch.float64)
            dist.all_reduce(figures)
            runs[split].append((*(figures / p).tolist(), wall * 1000))
    return {
        split: (
            statistics.median(r[0] for r in rs),
            statistics.median(r[1] for r in rs),
            statistics.median(r[2] for r in rs),
            min(r[2] for r in rs),
            max(r[2] for r in rs),
        )
        for split, rs in runs.items()
    }


def _worker(rank: int, p: int, port: int, args: argparse.Namespace, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=p)
    dims = None
    if args.mode == "real":
        from tessera.parallel import ParallelDims

        dims = ParallelDims(1, 1, 1, 1, p, 1, p)
        dims.build_mesh("cpu")
    try:
        for cost in args.sweep:
            for schedule in args.schedules:
                for m in args.microbatches:
                    rows = _rounds(rank, p, dims, schedule, m, cost, args)
                    if rank == 0:
                        for split, figures in rows.items():
                            queue.put((cost, split, schedule, m, *figures))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _numbers(kind):
    return lambda text: [kind(x) for x in text.split(",")]


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("sleep", "real"), default="sleep", help="artificial or tessera's stages")
    parser.add_argument("--cost-ms", type=_numbers(float), default=[5.0, 20.0, 80.0], help="sleep: F, B, W cost")
    parser.add_argument("--dims", type=_numbers(int), default=[64, 256, 512], help="real: model widths")
    parser.add_argument("--layers", type=int, default=8, help="real: decoder blocks (split over p * v stages)")
    parser.add_argument("--pp", type=_numbers(int), default=[2, 4], help="pipeline ranks")
    parser.add_argument("--microbatches", type=_numbers(int), default=[4, 8], help="micro-batches per step")
    parser.add_argument(
        "--schedules",
        type=lambda t: t.split(","),
        default=[s for s in SCHEDULES if s not in V_SCHEDULES],
        help="schedules (the V ones on request)",
    )
    parser.add_argument("--steps", type=int, default=2, help="timed steps per configuration")
    parser.add_argument("--splits", type=lambda t: t.split(","), default=["even"], help="real: even and/or cost")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds of the splits (median reported)")
    parser.add_argument("--vocab", type=int, default=0, help="real: vocabulary size (0: the tiny recipe's)")
    args = parser.parse_args()
    args.sweep = args.dims if args.mode == "real" else args.cost_ms
    return args


def main() -> None:
    args = _parse()
    ctx = mp.get_context("spawn")
    knob = "dim" if args.mode == "real" else "sleep ms"
    print(f"{args.mode} stages, 1 thread per rank, load average {os.getloadavg()[0]:.2f}")
    print(f"{args.rounds} interleaved round(s) per split, {args.steps} timed steps each; medians, step ms (min..max)")
    print(
        f"| {knob} | split | schedule | p | m | stage ms / micro-batch | step ms | measured idle | theoretical bubble "
        "| x theory |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for p in args.pp:
        queue = ctx.Queue()
        try:
            mp.spawn(_worker, args=(p, _free_port(), args, queue), nprocs=p)
        except mp.ProcessExitedException as exc:  # a rank can abort at exit after its work: keep what was measured
            print(f"(p={p}: {exc})")
        while not queue.empty():
            cost, split, schedule, m, idle, busy, wall, low, high = queue.get()
            theory = theoretical_bubble(schedule, p, m, _virtual(schedule))
            print(
                f"| {cost:g} | {split} | {schedule} | {p} | {m} | {busy:.1f} | {wall:.0f} ({low:.0f}..{high:.0f}) "
                f"| {idle:.3f} | {theory:.3f} | {idle / theory:.2f} |"
            )


if __name__ == "__main__":
    main()
