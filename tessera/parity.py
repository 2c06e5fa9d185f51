"""``tessera parity``: train a few steps of one recipe under several parallel layouts and compare.

Every layout starts from the same seed, weights and data, so in fp32 their per-step losses
should agree to about 1e-5 relative. The first layout is the reference (``single`` runs one
process without torchrun). Each layout is a comma-separated list of ``[parallel]`` keys, e.g.
``"dp_shard=2,tp=2"``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tessera.config import SECTIONS, ConfigError, load_config

_QUIET = [
    "log.every=1",
    "train.eval_every=0",
    "checkpoint.enabled=false",
    "train.sample_tokens=0",
    "log.plot=false",
    "log.tensorboard=false",
    "log.progress=none",
    "train.resume=none",
]


@dataclass
class Layout:
    """One parallel layout: its label, its ``parallel.*`` overrides and its process count."""

    label: str
    overrides: list[str]
    world_size: int


def parse_layout(spec: str) -> Layout:
    """``"dp_shard=2,tp=2"`` -> overrides and world size (unnamed data-parallel degrees are 1)."""
    if spec.strip() in ("single", "1"):
        return Layout("single", ["parallel.dp_shard=1"], 1)
    degrees = {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 1, "cp": 1}
    overrides = []
    fields = SECTIONS["parallel"].__dataclass_fields__
    for item in filter(None, (part.strip() for part in spec.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise ConfigError(
                f"layout '{spec}': '{item}' must be KEY=VALUE with a [parallel] key such as dp_shard=2 or tp=2"
            )
        if key in degrees:
            try:
                degrees[key] = int(value)
            except ValueError:
                raise ConfigError(f"layout '{spec}': {key} must be an integer, got {value!r}") from None
        overrides.append(f"parallel.{key}={value}")
    overrides += [f"parallel.{k}={v}" for k, v in degrees.items() if f"parallel.{k}=" not in " ".join(overrides)]
    world = degrees["dp_replicate"] * degrees["dp_shard"] * degrees["tp"] * degrees["pp"] * degrees["cp"]
    return Layout(spec, overrides, world)


def _command(layout: Layout, config: str, overrides: list[str]) -> list[str]:
    train = ["-m", "tessera", "train", config, *overrides]
    if layout.world_size == 1:
        return [sys.executable, *train]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={layout.world_size}",
        *train,
    ]


def run_layout(layout: Layout, config: str, overrides: list[str], steps: int, run_dir: Path) -> list[float]:
    """Train ``steps`` steps under ``layout``; the per-step training losses."""
    args = [*overrides, *_QUIET, *layout.overrides, f"train.steps={steps}", f"train.run_dir={run_dir}"]
    load_config(config, args)  # a bad layout fails here in one line, before any process starts
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run(_command(layout, config, args), capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"layout '{layout.label}' failed (exit {proc.returncode}):\n{tail}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def compare(losses: dict[str, list[float]]) -> dict[str, float]:
    """Max relative per-step difference of each layout against the first."""
    ref_label = next(iter(losses))
    ref = losses[ref_label]
    return {label: max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(curve, ref)) for label, curve in losses.items()}


def format_table(losses: dict[str, list[float]], rtol: float) -> str:
    """Per-step losses of the reference and relative differences of the others, then a verdict."""
    labels = list(losses)
    ref = losses[labels[0]]
    lines = [" | ".join(["step", f"{labels[0]} (loss)", *[f"{lab} (rel diff)" for lab in labels[1:]]])]
    for i, value in enumerate(ref):
        diffs = [f"{abs(losses[lab][i] - value) / abs(value):.2e}" for lab in labels[1:]]
        lines.append(" | ".join([str(i + 1), f"{value:.6f}", *diffs]))
    worst = compare(losses)
    lines.append("")
    for lab in labels[1:]:
        verdict = "ok" if worst[lab] <= rtol else "MISMATCH"
        lines.append(f"{lab}: max rel diff {worst[lab]:.2e} ({verdict}, rtol {rtol:g})")
    return "\n".join(lines)


def parity(
    config: str,
    layouts: list[str],
    overrides: list[str],
    steps: int = 5,
    rtol: float = 1e-5,
    work_dir: str | None = None,
) -> tuple[str, bool]:
    """Run every layout and return the table and whether all agree within ``rtol``."""
    if len(layouts) < 2:
        raise ConfigError("tessera parity needs at least two --layouts to compare (e.g. single dp_shard=2)")
    parsed = [parse_layout(spec) for spec in layouts]
    root = Path(work_dir or tempfile.mkdtemp(prefix="tessera-parity-"))
    losses = {}
    for i, layout in enumerate(parsed):
        losses[layout.label] = run_layout(layout, config, overrides, steps, root / f"layout{i}")
    worst = compare(losses)
    return format_table(losses, rtol), all(v <= rtol for v in worst.values())
