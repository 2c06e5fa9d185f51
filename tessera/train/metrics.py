"""Training metrics: a live console line, metrics.jsonl, TensorBoard events and a loss plot."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import torch


def _human(n: float) -> str:
    for unit in ("", "k", "M", "G"):
        if abs(n) < 1000:
            return f"{n:.1f}{unit}"
        n /= 1000
    return f"{n:.1f}T"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def format_step(record: dict[str, Any], total_steps: int, eta_s: float | None) -> str:
    """One human line for a logged step."""
    parts = [f"step {record['step']}/{total_steps}"]
    if "loss" in record:
        parts += [f"loss {record['loss']:.4f}", f"lr {record['lr']:.2e}", f"gnorm {record['grad_norm']:.3f}"]
        parts += [f"{_human(record['tokens_per_s'])} tok/s", f"mfu {100 * record['mfu']:.2f}%"]
    if "val_loss" in record:
        parts.append(f"val {record['val_loss']:.4f} (ppl {record['val_ppl']:.1f})")
    if eta_s is not None:
        parts.append(f"eta {_duration(eta_s)}")
    return " | ".join(parts)


class MetricsLogger:
    """Writes each record to metrics.jsonl and TensorBoard and shows progress on the console.

    ``progress``: "bar" rewrites one live line (a terminal), "lines" prints a line per logged
    step (logs, CI), "none" prints nothing, "auto" picks "bar" on a terminal else "lines".
    """

    def __init__(
        self, run_dir: str | Path, total_steps: int, progress: str = "auto", tensorboard: bool = True, stream: TextIO | None = None, enabled: bool = True
    ) -> None:
        self.run_dir = Path(run_dir)
        self.total_steps = total_steps
        self.stream = stream or sys.stdout
        if progress == "auto":
            progress = "bar" if self.stream.isatty() else "lines"
        self.enabled = enabled
        self.progress = progress if enabled else "none"
        self.jsonl = open(self.run_dir / "metrics.jsonl", "a") if enabled else None
        self.tb = None
        if tensorboard and enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        self.started = time.perf_counter()
        self.start_step: int | None = None

    def log(self, record: dict[str, Any]) -> None:
        """Record one step's metrics (``step`` plus any numbers); a disabled logger (ranks > 0) drops it."""
        if self.jsonl is None:
            return
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tb.add_scalar(key, value, record["step"])
                elif isinstance(value, list) and value and isinstance(value[0], list):  # e.g. load per layer, expert
                    for i, row in enumerate(value):
                        self.tb.add_histogram(f"{key}/{i}", torch.tensor(row), record["step"])
        self._show(record)

    def _eta(self, step: int) -> float | None:
        if self.start_step is None:
            self.start_step, self.started = step, time.perf_counter()
            return None
        done = step - self.start_step
        return (time.perf_counter() - self.started) / done * (self.total_steps - step) if done > 0 else None

    def _show(self, record: dict[str, Any]) -> None:
        if self.progress == "none":
            return
        line = format_step(record, self.total_steps, self._eta(record["step"]))
        if self.progress == "bar":
            self.stream.write("\r\033[K" + line + ("\n" if "val_loss" in record or record["step"] == self.total_steps else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def print(self, message: str) -> None:
        """A message on the console (a fresh line even while the bar is live)."""
        if self.progress != "none":
            self.stream.write(message + "\n")
            self.stream.flush()

    def close(self) -> None:
        """Flush and close the sinks."""
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All records of a run's metrics.jsonl."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def plot_loss_curve(run_dir: str | Path) -> Path:
    """Draw training and validation loss against step into ``loss_curve.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        ax.plot(*zip(*train), label="train loss", linewidth=1)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss", markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(Path(run_dir).name)
    ax.grid(alpha=0.3)
    ax.legend()
    out = Path(run_dir) / "loss_curve.png"
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
