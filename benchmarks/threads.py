"""Torch threads on a busy machine: the smoke job's training step at 1 and at every-core threads, under
0..N other busy processes, to check the default policy of ``tessera/threads.py``.

One process builds the smoke recipe's ``Trainer`` (its real data loader, fused head + loss, AdamW)
and times ``train_step`` with ``torch.set_num_threads(1)`` and with one thread per core, in
interleaved rounds, while ``k`` busy-loop processes (stand-ins for other jobs: each keeps one core
runnable) run beside it, for each ``k`` of ``--loads``. Printed per load: the median seconds per
step of each thread count with the spread, their ratio, the choice the default policy
(``tessera.threads.choose_threads``, which samples the other work on the machine) makes with the
``k`` processes running, and how far that choice is from the best one. Run it on an otherwise idle machine:

    python benchmarks/threads.py                       # loads 0..4, 3 rounds of 8 steps
    python benchmarks/threads.py --loads 0,2,4 --rounds 5
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tessera.threads import choose_threads, usable_cores

REPO = Path(__file__).resolve().parents[1]


def smoke_step(workdir: Path) -> Callable[[], None]:
    """The smoke recipe's ``Trainer.train_step`` (evaluation, checkpoints and logging off)."""
    from tessera.train.trainer import Trainer
    from tessera.validate import load_config

    overrides = [
        f"train.run_dir={workdir / 'run'}",
        "train.steps=100000",
        "train.eval_every=0",
        "train.sample_tokens=0",
        "train.threads=1",
        "train.resume=none",
        "checkpoint.enabled=false",
        "log.progress=none",
        "log.tensorboard=false",
        "log.plot=false",
    ]
    return Trainer(load_config(str(REPO / "configs" / "smoke.toml"), overrides)).train_step


def _spin() -> None:
    while True:
        pass


def start_load(k: int) -> list[multiprocessing.Process]:
    """``k`` processes that each keep a core busy until terminated."""
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(k)]
    for spinner in spinners:
        spinner.start()
    return spinners


def seconds_per_step(step: Callable[[], None], threads: int, n: int) -> float:
    """Wall seconds per step over ``n`` steps at ``threads`` intra-op threads."""
    torch.set_num_threads(threads)
    start = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - start) / n


def measure_load(
    step: Callable[[], None], k: int, args: argparse.Namespace, cores: int
) -> tuple[dict[int, list[float]], int]:
    """Seconds per step of each thread count over interleaved rounds, with ``k`` busy processes beside,
    and the thread count the default policy chooses among them."""
    spinners = start_load(k)
    try:
        time.sleep(1.0)
        chosen = choose_threads(0, 1, {}).threads
        seconds_per_step(step, cores, args.warmup)
        times: dict[int, list[float]] = {1: [], cores: []}
        for _ in range(args.rounds):
            for threads in times:
                times[threads].append(seconds_per_step(step, threads, args.steps))
        return times, chosen
    finally:
        for spinner in spinners:
            spinner.terminate()
            spinner.join()


def row(k: int, times: dict[int, list[float]], cores: int, chosen: int) -> str:
    """One table row: medians (spread), the ratio, the policy's choice and its cost against the best."""
    medians = {t: statistics.median(v) for t, v in times.items()}
    cells = [f"{medians[t]:.3f} ({min(v):.3f}..{max(v):.3f})" for t, v in times.items()]
    cost = f"{medians[chosen] / min(medians.values()):.2f}" if chosen in medians else "not timed"
    return f"| {k} | {' | '.join(cells)} | {medians[cores] / medians[1]:.2f} | {chosen} | {cost} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loads", default="0,1,2,3,4", help="busy processes beside the job, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per thread count per round")
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    cores = usable_cores()
    with tempfile.TemporaryDirectory() as tmp:
        step = smoke_step(Path(tmp))
        print(f"cores {cores}; smoke recipe, seconds per step")
        print(f"| busy processes | 1 thread | {cores} threads | {cores}/1 | policy picks | policy / best |")
        print("|---|---|---|---|---|---|")
        for k in (int(x) for x in args.loads.split(",")):
            times, chosen = measure_load(step, k, args, cores)
            print(row(k, times, cores, chosen), flush=True)


if __name__ == "__main__":
    main()
