"""Goodput: the share of a run's wall time that trained steps which count.

Every second of a session (rank 0's clock) goes to one bucket:

- ``productive``: optimizer steps that stay in the run's history;
- ``startup``: building data, model and optimizer and restoring a checkpoint, before the first step;
- ``restart``: the gap between the previous session's last metrics record and this session's start
  (the crash, its detection, the relaunch), for a run that continues an earlier one;
- ``recomputed``: steps trained again after a resume because they came after the checkpoint
  (their count is ``recomputed_steps``);
- ``checkpoint``: the loop stalled in saves; ``eval``: evaluations;
- ``rollback``: ``train.on_spike=rollback``'s restores plus the discarded steps' time.

The totals add over sessions (``RUN/goodput.json``, refreshed at every logged record, and
``summary.json``); ``fraction`` = productive / all buckets.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tessera.train.lock import read_json

FILE = "goodput.json"
LOST = ("startup", "restart", "recomputed", "checkpoint", "eval", "rollback")


class Goodput:
    """One session's buckets, added to the earlier sessions' (see the module doc)."""

    def __init__(self, run_dir: str | Path, enabled: bool, built_at: float) -> None:
        self.path = Path(run_dir) / FILE
        self.enabled = enabled
        self.built_at = built_at  # time.time() when the Trainer began building
        self.seconds = dict.fromkeys(("productive", *LOST), 0.0)
        self.recomputed_steps = 0
        self.redo_until = 0  # steps up to this one were trained before the restart
        self.step_seconds: dict[int, float] = {}
        self.earlier: dict[str, Any] = {}

    def begin(self, resumed_step: int, records: list[dict[str, Any]]) -> None:
        """Before the loop: ``records`` are the run's metrics.jsonl records as the previous session left them."""
        if records:
            self.earlier = read_json(self.path)
        trained = [r["step"] for r in records if "loss" in r]
        if trained and resumed_step < max(trained):
            self.redo_until = max(trained)
        if records:
            self.seconds["restart"] = max(0.0, self.built_at - records[-1].get("time", self.built_at))
        self.seconds["startup"] = max(0.0, time.time() - self.built_at)

    def step(self, step: int, seconds: float) -> None:
        """Optimizer step ``step`` took ``seconds``."""
        if step <= self.redo_until:
            self.seconds["recomputed"] += seconds
            self.recomputed_steps += 1
        else:
            self.seconds["productive"] += seconds
            self.step_seconds[step] = seconds

    @contextlib.contextmanager
    def timed(self, bucket: str) -> Iterator[None]:
        """Count the block's seconds as ``bucket`` (checkpoint, eval, rollback)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[bucket] += time.perf_counter() - start

    def discard(self, after_step: int) -> None:
        """A rollback to ``after_step``: the steps after it move from productive to rollback."""
        for step in [s for s in self.step_seconds if s > after_step]:
            seconds = self.step_seconds.pop(step)
            self.seconds["productive"] -= seconds
            self.seconds["rollback"] += seconds

    def totals(self) -> dict[str, Any]:
        """This and the earlier sessions' buckets, the recomputed steps and the productive fraction."""
        earlier = self.earlier.get("seconds", {})
        seconds = {k: round(v + float(earlier.get(k, 0.0)), 3) for k, v in self.seconds.items()}
        total = sum(seconds.values())
        return {
            "fraction": round(seconds["productive"] / total, 4) if total else 0.0,
            "seconds": seconds,
            "recomputed_steps": self.recomputed_steps + int(self.earlier.get("recomputed_steps", 0)),
            "sessions": int(self.earlier.get("sessions", 0)) + 1,
        }

    def write(self) -> None:
        """Refresh ``RUN/goodput.json`` (rank 0)."""
        if self.enabled:
            self.path.write_text(json.dumps(self.totals(), indent=1), encoding="utf-8")


def status_line(run_dir: str | Path) -> list[str]:
    """``tessera status``'s goodput line from ``RUN/goodput.json`` (none when absent)."""
    data = read_json(Path(run_dir) / FILE)
    if not data:
        return []
    s = data["seconds"]
    lost = ", ".join(f"{k} {s[k]:.1f} s" for k in LOST if s.get(k))
    redo = f" ({data['recomputed_steps']} steps recomputed)" if data.get("recomputed_steps") else ""
    line = f"{100 * data['fraction']:.1f}% productive ({s['productive']:.1f} s) over {data['sessions']} session(s)"
    return [f"{'goodput':<12} {line}; lost: {lost or 'nothing'}{redo}"]
