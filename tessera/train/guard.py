"""Guards around the training loop: the non-finite policy and the hang watchdog.

Non-finite numbers: once per optimizer step (the loss and the global gradient norm are already
plain Python floats there, so no extra host sync), ``train.on_nonfinite`` decides: ``stop``
raises before the update is applied and before anything is saved; ``skip`` drops the update,
counts it, and stops after ``train.max_nonfinite_skips`` skipped steps in a row.

Hangs: :class:`HangWatchdog` is a thread that waits for the loop to report progress (a step,
an evaluation or a checkpoint). When none arrives within ``train.hang_timeout_s`` (a dead peer,
a stuck collective; three times that before the first step completes), it writes every
thread's Python stack to ``RUN/hang/rank_K.txt`` and ends the process with
:data:`HANG_EXIT_CODE`, so torchrun or SLURM can restart the job. Every rank runs one: the
ranks waiting on a stalled peer time out too and leave their stacks. Each rank also writes its last
collective per process group (kind, sequence number, completed; torch's flight recorder, see
``parallel/collective_log.py``) to ``RUN/hang/rank_K.json``; after the grace period rank 0 joins them
into ``RUN/hang/report.txt``, which names the rank that is behind and the collective the others wait in.
"""

from __future__ import annotations

import faulthandler
import json
import math
import os
import sys
import threading
import time
from pathlib import Path

from tessera.config import ConfigError
from tessera.parallel.collective_log import describe_hang, last_collectives

HANG_DIR = "hang"
HANG_EXIT_CODE = 124  # as timeout(1): the process was stopped because it made no progress in time
FIRST_STEP_FACTOR = 3  # the first step may take this many timeouts
_LIKELY_CAUSES = (
    "likely causes: optim.lr too high (or optim.grad_clip=0), optim.eps too small, or bad data near this step; "
    "resume from the last checkpoint with a lower optim.lr"
)


class NonFiniteError(ConfigError):
    """Training produced a NaN or infinite loss or gradient norm (a user-fixable setting, one line)."""


class NonFiniteGuard:
    """Applies ``train.on_nonfinite`` to each optimizer step's loss and gradient norm."""

    def __init__(self, policy: str, max_skips: int) -> None:
        self.policy, self.max_skips = policy, max_skips
        self.skipped = 0  # skipped updates in this process
        self.in_a_row = 0

    def allows_update(self, step: int, loss: float, grad_norm: float, lr: float) -> bool:
        """True when step ``step`` may update the weights; False to skip it; raises to stop the run."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.in_a_row = 0
            return True
        what = f"step {step}: loss {loss}, grad norm {grad_norm} at lr {lr:.3g}"
        if self.policy == "stop":
            raise NonFiniteError(
                f"{what}; stopped before the update and before saving (train.on_nonfinite=stop); {_LIKELY_CAUSES}, "
                "or set train.on_nonfinite=skip"
            )
        self.skipped += 1
        self.in_a_row += 1
        if self.in_a_row >= self.max_skips:
            raise NonFiniteError(
                f"{what}; {self.in_a_row} steps in a row were non-finite and skipped (train.max_nonfinite_skips="
                f"{self.max_skips}), stopped before saving; {_LIKELY_CAUSES}"
            )
        return False


class HangWatchdog:
    """Dumps all threads' stacks and exits when :meth:`kick` is not called for ``timeout_s`` (0 disables)."""

    def __init__(self, run_dir: str | Path, rank: int, timeout_s: float, grace_s: float | None = None) -> None:
        """``grace_s``: how long a rank that timed out waits before exiting, so that the peers whose deadlines
        are a moment later dump their stacks too (an exit would break their collectives first)."""
        self.path = Path(run_dir) / HANG_DIR / f"rank_{rank}.txt"
        self.rank, self.timeout_s = rank, timeout_s
        self.grace_s = min(60.0, max(5.0, timeout_s / 10)) if grace_s is None else grace_s
        self.step = 0
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> HangWatchdog:
        if self.timeout_s > 0:
            self._last = time.monotonic()
            self._thread = threading.Thread(target=self._watch, name="tessera-hang-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def kick(self, step: int) -> None:
        """Report progress: step ``step`` (or its evaluation or checkpoint) completed."""
        self.step = step
        self._last = time.monotonic()

    def _watch(self) -> None:
        while not self._stop.wait(min(0.5, self.timeout_s / 4)):
            idle = time.monotonic() - self._last
            # The first step compiles, warms up and waits for the slowest rank to arrive: it gets longer.
            if idle > self.timeout_s * (FIRST_STEP_FACTOR if self.step == 0 else 1):
                self._fire(idle)

    def _fire(self, idle: float) -> None:
        header = (
            f"rank {self.rank} (pid {os.getpid()}): no training progress for {idle:.0f}s after step {self.step} "
            f"(train.hang_timeout_s={self.timeout_s:g}); Python stacks of all threads:\n"
        )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        collectives = last_collectives()
        self.path.with_suffix(".json").write_text(
            json.dumps({"rank": self.rank, "step": self.step, "last": collectives})
        )
        with open(self.path, "w", encoding="utf-8") as f:
            f.write(header)
            f.write("".join(f"last collective: {c}\n" for c in collectives))
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        sys.stderr.write(
            f"tessera: error: rank {self.rank} made no progress for {idle:.0f}s after step {self.step} (a stalled "
            f"peer or collective?); stacks in {self.path}; exiting with code {HANG_EXIT_CODE} so the launcher can "
            "restart the job\n"
        )
        sys.stderr.flush()
        time.sleep(self.grace_s)
        if self.rank == 0:
            self._report()
        os._exit(HANG_EXIT_CODE)

    def _report(self) -> None:
        """Join the ranks' last collectives into ``hang/report.txt`` and say on stderr who is behind."""
        per_rank = {}
        for path in self.path.parent.glob("rank_*.json"):
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except ValueError:
                continue
            per_rank[int(data["rank"])] = data["last"]
        lines = describe_hang(per_rank) or ["every rank's last collectives agree (a hang outside collectives?)"]
        report = self.path.parent / "report.txt"
        report.write_text(f"ranks that reported: {sorted(per_rank)}\n" + "\n".join(lines) + "\n", encoding="utf-8")
        sys.stderr.write("".join(f"tessera: hang: {line}\n" for line in lines))
        sys.stderr.flush()
