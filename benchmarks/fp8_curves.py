"""Overlay the loss curves of bf16 and fp8 runs of one recipe and print their final validation losses.

    python benchmarks/fp8_curves.py OUT.png bf16=runs/a tensorwise=runs/b rowwise=runs/c mxfp8=runs/d

The first run is the reference: each other's final validation loss is reported relative to it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    out, runs = Path(sys.argv[1]), dict(arg.split("=", 1) for arg in sys.argv[2:])
    fig, (train_ax, val_ax) = plt.subplots(1, 2, figsize=(11, 4))
    final = {}
    for name, run in runs.items():
        records = _records(Path(run))
        train = [(r["step"], r["loss"]) for r in records if "loss" in r]
        val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
        train_ax.plot(*zip(*train), label=name, lw=1)
        val_ax.plot(*zip(*val), label=name, marker="o", ms=3, lw=1)
        final[name] = val[-1][1]
    for ax, title in ((train_ax, "training loss"), (val_ax, "validation loss")):
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    ref_name = next(iter(final))
    for name, loss in final.items():
        print(f"{name:<11} final val loss {loss:.4f}  {100 * (loss / final[ref_name] - 1):+.2f}% vs {ref_name}")


if __name__ == "__main__":
    main()
