"""Loss-spike detection and rollback (``train.on_spike``), as PaLM did by hand.

The threshold is robust: over the last ``train.spike_window`` accepted steps, a step's loss (and,
separately, its global gradient norm) is a spike when it exceeds

    median + spike_threshold * max(1.4826 * MAD, 0.01 * median)

where MAD is the median absolute deviation (1.4826 * MAD estimates the standard deviation of
normal noise, and, unlike a mean and standard deviation, one earlier spike in the window does not
move it). The 1% floor keeps a flat window (MAD near 0) from calling ordinary noise a spike.
Nothing is judged until the window is full, so warm-up's fast-falling loss is never one.

``warn`` logs the spike and trains on. ``rollback`` drops the spiking update, restores the
newest checkpoint (which is older than the spike, since the spike is judged before the step's
save), keeps the data loader at the position after the spiking batch (so the batches since the
checkpoint, the bad one included, are skipped), and records what it did. The decision reads
the globally reduced loss and gradient norm, so every rank decides the same.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass

import numpy as np

from tessera.config import ConfigError

MAD_TO_SIGMA = 1.4826  # MAD of normal noise times this is its standard deviation
RELATIVE_FLOOR = 0.01  # the spread never counts as less than 1% of the median


class SpikeError(ConfigError):
    """Too many rollbacks in one run: the spikes are not the data's fault (one line, exit 2)."""


@dataclass
class Spike:
    """One detected spike: which metric, its value and the threshold it crossed."""

    step: int
    metric: str
    value: float
    threshold: float

    def describe(self) -> str:
        """One line for the console."""
        return f"step {self.step}: {self.metric} {self.value:.4g} > spike threshold {self.threshold:.4g}"


def robust_threshold(values: list[float], k: float) -> float:
    """``median + k * max(1.4826 * MAD, 1% of |median|)`` of ``values`` (see the module doc)."""
    arr = np.asarray(values, dtype=np.float64)
    median = float(np.median(arr))
    mad = float(np.median(np.abs(arr - median)))
    return median + k * max(MAD_TO_SIGMA * mad, RELATIVE_FLOOR * abs(median))


class SpikeGuard:
    """Applies ``train.on_spike`` to each optimizer step's loss and gradient norm (host floats: no sync)."""

    def __init__(self, policy: str, window: int, k: float, max_rollbacks: int) -> None:
        self.policy, self.window, self.k, self.max_rollbacks = policy, window, k, max_rollbacks
        self.history: deque[tuple[int, float, float]] = deque(maxlen=window)  # (step, loss, grad norm)
        self.pending: Spike | None = None  # a spike that asks for a rollback, until the trainer does it
        self.events: list[dict] = []  # what happened, for metrics.jsonl and summary.json
        self._warned: list[Spike] = []  # train.on_spike=warn: spikes not yet logged

    @classmethod
    def for_train(cls, train: object) -> SpikeGuard:
        """The guard ``train.on_spike`` and its keys ask for."""
        return cls(train.on_spike, train.spike_window, train.spike_threshold, train.max_rollbacks)

    def judge(self, step: int, loss: float, grad_norm: float) -> bool:
        """True when step ``step``'s update may be applied; False when it spiked and a rollback is pending."""
        if self.policy == "off" or not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return True  # non-finite steps are train.on_nonfinite's
        spike = self._spike(step, loss, grad_norm)
        if spike is None:
            self.history.append((step, loss, grad_norm))
            return True
        self.events.append({"step": step, "action": self.policy, **asdict(spike)})
        if self.policy == "warn":
            self._warned.append(spike)
            return True
        self.pending = spike
        return False

    def _spike(self, step: int, loss: float, grad_norm: float) -> Spike | None:
        if len(self.history) < self.window:
            return None
        for index, (metric, value) in enumerate((("loss", loss), ("grad_norm", grad_norm)), start=1):
            threshold = robust_threshold([h[index] for h in self.history], self.k)
            if value > threshold:
                return Spike(step, metric, value, threshold)
        return None

    def take_new(self) -> list[Spike]:
        """The spikes ``warn`` let through since the last call (to log)."""
        new, self._warned = self._warned, []
        return new

    def rolled_back(self, to_step: int, skipped: tuple[int, int]) -> dict:
        """Record the rollback of the pending spike to checkpoint ``to_step``; ``skipped``: the global sample
        positions [start, end) never trained on. Returns the metrics.jsonl record; raises past the limit."""
        spike, self.pending = self.pending, None
        while self.history and self.history[-1][0] > to_step:
            self.history.pop()
        event = self.events[-1]
        event.update(restored_step=to_step, skipped_samples=list(skipped))
        done = sum(1 for e in self.events if "restored_step" in e)
        if done > self.max_rollbacks:
            raise SpikeError(
                f"{spike.describe()}: rollback {done} exceeds train.max_rollbacks={self.max_rollbacks}; the spikes "
                "persist after skipping data: lower optim.lr, raise optim.warmup_steps or train.spike_threshold"
            )
        return {"step": spike.step, "rollback": event}

    def no_checkpoint(self) -> dict:
        """Record that the pending spike had no checkpoint to roll back to (its update was dropped)."""
        spike, self.pending = self.pending, None
        self.events[-1]["restored_step"] = None
        return {"step": spike.step, "rollback": self.events[-1]}
