"""Spawned by test_async_checkpoint: two gloo ranks whose clocks disagree ask SaveSchedule when to save."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tessera.train.save_schedule import SaveSchedule


def decide(rank: int, port: int, out) -> None:
    """Rank 1's clock runs 30 s per step, rank 0's stands still; put (rank, decisions of steps 1..8) on ``out``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    now = [0.0]
    schedule = SaveSchedule(every=1000, every_minutes=1.0, total_steps=1000, clock=lambda: now[0])
    decisions = []
    for step in range(1, 9):
        now[0] += 30.0 * rank
        decisions.append(schedule.due(step))
    out.put((rank, decisions))
    dist.destroy_process_group()
