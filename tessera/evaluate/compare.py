"""``tessera compare RUN...``: several runs' curves on the same axes and a table of their final figures.

Reads each run's metrics.jsonl as it is, also while the run is still writing it (a torn last line is
skipped). Curves: training loss, validation loss and every downstream score (``eval/<task>/<metric>``),
against step or tokens (step x ``tokens_per_step`` from the run's config, when it has one).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tomllib

from tessera.config import ConfigError


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    """The run's metrics records in order; a line torn by a writer mid-write (or a crash) is skipped."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"'{run_dir}' has no metrics.jsonl; give run directories (train.run_dir)")
    records = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def tokens_per_step(run_dir: Path) -> int:
    """batch_size x grad_accum x seq_len of the run's config.toml (0 when unknown)."""
    try:
        train = tomllib.loads((run_dir / "config.toml").read_text(encoding="utf-8")).get("train", {})
    except (OSError, tomllib.TOMLDecodeError):
        return 0
    return int(train.get("batch_size", 0)) * int(train.get("grad_accum", 1)) * int(train.get("seq_len", 0))


def series(records: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """(step, value) of ``key``, the last record of a step winning (a resumed run rewrites steps)."""
    points: dict[int, float] = {}
    for r in records:
        if isinstance(r.get(key), (int, float)):
            points[r["step"]] = float(r[key])
    return sorted(points.items())


def curve_keys(all_records: list[list[dict[str, Any]]]) -> list[str]:
    """The curves to draw: loss, val_loss and every eval/ key any run has."""
    found = {k for records in all_records for r in records for k in r if k.startswith("eval/")}
    return ["loss", "val_loss", *sorted(found)]


def final_table(names: list[str], all_records: list[list[dict[str, Any]]], keys: list[str]) -> str:
    """A Markdown table: each run's last step and last value of every curve."""
    head = "| run | step | " + " | ".join(keys) + " |"
    lines = [head, "|" + "---|" * (len(keys) + 2)]
    for name, records in zip(names, all_records):
        step = max((r["step"] for r in records), default=0)
        cells = []
        for key in keys:
            points = series(records, key)
            cells.append(f"{points[-1][1]:.4g}" if points else "-")
        lines.append(f"| {name} | {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def compare_runs(run_dirs: list[str], out: Path, x: str = "step") -> tuple[str, Path]:
    """The table of final figures and a PNG with one panel per curve, every run overlaid on the same axes."""
    if x not in ("step", "tokens"):
        raise ConfigError(f"--x {x!r} is not one of step, tokens")
    dirs = [Path(d) for d in run_dirs]
    names = _names(dirs)
    all_records = [read_records(d) for d in dirs]
    keys = curve_keys(all_records)
    scale = [tokens_per_step(d) if x == "tokens" else 1 for d in dirs]
    if x == "tokens" and not all(scale):
        missing = dirs[scale.index(0)]
        raise ConfigError(f"--x tokens: '{missing}' has no config.toml with train.seq_len; use --x step")
    _plot(names, all_records, keys, scale, x, out)
    return final_table(names, all_records, keys), out


def _names(dirs: list[Path]) -> list[str]:
    names = [d.name for d in dirs]
    return names if len(set(names)) == len(names) else [str(d) for d in dirs]


def _plot(names, all_records, keys, scale, x: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(len(keys), 3)
    rows = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), dpi=100, squeeze=False)
    for ax, key in zip(axes.flat, keys):
        for name, records, s in zip(names, all_records, scale):
            points = series(records, key)
            if points:
                ax.plot(
                    [p * s for p, _ in points],
                    [v for _, v in points],
                    "-" if key == "loss" else "o-",
                    label=name,
                    markersize=3,
                    linewidth=1,
                )
        ax.set_title(key)
        ax.set_xlabel(x)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
