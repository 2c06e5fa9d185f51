"""Stopping cleanly: on SIGTERM, SIGUSR1 or Ctrl-C (SIGINT) finish the step, checkpoint, and exit.

Clusters stop jobs with a signal: SLURM sends SIGTERM on preemption or ``scancel
--signal=TERM``, and the signal of ``--signal=USR1@SECONDS`` before the time limit; torchrun
forwards both to its workers. :class:`PreemptionGuard` only records the signal; the training
loop asks :meth:`PreemptionGuard.stop_requested` once per step (all ranks agree through one
all-reduce, so every rank stops after the same step), saves a checkpoint, and the process exits
with :data:`PREEMPTED_EXIT_CODE`. Rank 0 leaves :data:`PREEMPTION_MARKER` in the run directory;
tessera's sbatch script requeues the job when it finds it, and the requeued job resumes from
the checkpoint with ``train.resume = "auto"``.

Ctrl-C (SIGINT) stops the same way but is the user's decision, not the cluster's: no marker
(nothing requeues it), exit code 130 (128 + SIGINT, the shell convention), and a second Ctrl-C
aborts at once without saving, also while a checkpoint is written in the background (it is not committed).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL (sysexits.h): stopped early, run it again to continue
INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT  # 130: what a shell reports for a Ctrl-C
PREEMPTION_MARKER = "preempted.json"


def _is_rank_zero() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class PreemptionGuard:
    """Records a preemption signal while installed; the loop polls :meth:`stop_requested`."""

    def __init__(
        self, run_dir: str | Path, signals: tuple[signal.Signals, ...] = PREEMPTION_SIGNALS, echo_s: float = 0.0
    ) -> None:
        """``echo_s``: a second SIGINT this soon after the first is an echo, not a second Ctrl-C (torchrun
        forwards the terminal's SIGINT to workers that the terminal already signalled)."""
        self.run_dir = Path(run_dir)
        self.signals = signals
        self.echo_s = echo_s
        self.received: signal.Signals | None = None
        self._received_at = 0.0
        self._previous: dict[signal.Signals, Any] = {}

    def install(self) -> PreemptionGuard:
        """Catch the signals (main thread only; elsewhere Python cannot) and clear an old marker."""
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        if _is_rank_zero():
            (self.run_dir / PREEMPTION_MARKER).unlink(missing_ok=True)
        return self

    def uninstall(self) -> None:
        """Restore the handlers that were there before :meth:`install`."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            if time.monotonic() - self._received_at < self.echo_s:
                return
            raise KeyboardInterrupt  # the second Ctrl-C: abort now, without saving
        if signum == signal.SIGINT and self.received is None and _is_rank_zero():
            # os.write, not print: a handler may run while the main thread is inside a print.
            os.write(2, b"\ntessera: Ctrl-C: finishing this step and saving; Ctrl-C again aborts without saving\n")
        if self.received is None:
            self.received, self._received_at = signal.Signals(signum), time.monotonic()

    def stop_requested(self, device: torch.device) -> bool:
        """Whether any rank has received a preemption signal (a collective when distributed)."""
        local = self.received is not None
        if not (dist.is_available() and dist.is_initialized()):
            return local
        flag = torch.tensor([int(local)], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    @property
    def reason(self) -> str:
        """The signal this process received, or a note that another rank received one."""
        return self.received.name if self.received is not None else "a signal on another rank"

    @property
    def interrupted(self) -> bool:
        """Whether the stop is a user's Ctrl-C (no requeue) rather than a cluster's signal."""
        return self.received == signal.SIGINT

    def record(self, step: int, checkpoint: Path) -> str:
        """Leave the marker (rank 0; not for Ctrl-C) and return the line to print before exiting."""
        name = self.reason
        if self.interrupted:
            return (
                f"interrupted by SIGINT: saved step {step} to {checkpoint}; exiting with code {INTERRUPTED_EXIT_CODE}; "
                "run the same command to resume"
            )
        if _is_rank_zero():
            marker = {"step": step, "signal": name, "checkpoint": str(checkpoint), "exit_code": PREEMPTED_EXIT_CODE}
            (self.run_dir / PREEMPTION_MARKER).write_text(json.dumps(marker) + "\n")
        return (
            f"preempted by {name}: saved step {step} to {checkpoint}; exiting with code {PREEMPTED_EXIT_CODE} "
            "so the job is requeued and resumes there"
        )


def stop_exit_code(reason: str) -> int:
    """The process exit code for a run that stopped early for ``reason`` (a signal name; "" = finished)."""
    if not reason:
        return 0
    return INTERRUPTED_EXIT_CODE if reason == "SIGINT" else PREEMPTED_EXIT_CODE


def exit_interrupted() -> int:
    """After a second Ctrl-C: :data:`INTERRUPTED_EXIT_CODE`, at once even while a background write runs.

    A background thread (``checkpoint.async``'s writer, an HF export) would hold the interpreter's exit
    until it ends; the abort promised "at once", so the process ends here instead (the abandoned write
    left only a ``.tmp`` directory, which no reader takes for a checkpoint and the next save removes).
    """
    busy = [t for t in threading.enumerate() if t.is_alive() and not t.daemon and t is not threading.main_thread()]
    if busy:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(INTERRUPTED_EXIT_CODE)
    return INTERRUPTED_EXIT_CODE
