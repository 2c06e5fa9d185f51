"""``tessera parity``: train a few steps of one recipe under several parallel layouts and compare.

Every layout starts from the same seed, weights and data, so in fp32 their per-step losses and
gradient norms should agree to about 1e-5 relative (the grad norm catches a wrong gradient scale
that AdamW hides from the loss). The first layout is the reference (``single`` runs one
process without torchrun). Each layout is a comma-separated list of ``[parallel]`` keys, e.g.
``"dp_shard=2,tp=2"``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tessera.config import SECTIONS, ConfigError
from tessera.validate import load_config

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


def split_overrides(layouts: list[str], overrides: list[str]) -> tuple[list[str], list[str]]:
    """Config overrides (``section.key=value``, as for ``tessera train``) given after ``--layouts``
    are overrides, not layouts: layout specs never name a section."""
    found = [item for item in layouts if re.match(r"^-{0,2}[A-Za-z_]\w*\.[\w.]+=", item)]
    return [item for item in layouts if item not in found], [*overrides, *found]


Curves = dict[str, list[float]]  # metric ("loss", "grad_norm") -> per-step values


def run_layout(layout: Layout, config: str, overrides: list[str], steps: int, run_dir: Path) -> Curves:
    """Train ``steps`` steps under ``layout``; its per-step training losses and grad norms."""
    args = [*overrides, *_QUIET, *layout.overrides, f"train.steps={steps}", f"train.run_dir={run_dir}"]
    load_config(config, args)  # a bad layout fails here in one line, before any process starts
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run(_command(layout, config, args), capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"layout '{layout.label}' failed (exit {proc.returncode}):\n{tail}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in records if "loss" in r]
    return {"loss": [r["loss"] for r in steps_], "grad_norm": [r["grad_norm"] for r in steps_]}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def compare(curves: dict[str, Curves]) -> dict[str, float]:
    """Max relative per-step difference (loss or grad norm) of each layout against the first."""
    ref = next(iter(curves.values()))
    return {
        label: max(_rel(a, b) for metric in ref for a, b in zip(curve[metric], ref[metric]))
        for label, curve in curves.items()
    }


def format_table(curves: dict[str, Curves], rtol: float) -> str:
    """Per-step loss and grad norm of the reference, relative differences of the others, a verdict."""
    labels = list(curves)
    ref = curves[labels[0]]
    header = ["step", f"{labels[0]} loss", "grad norm"]
    header += [f"{lab} rel diff (loss / gnorm)" for lab in labels[1:]]
    lines = [" | ".join(header)]
    for i, (loss, gnorm) in enumerate(zip(ref["loss"], ref["grad_norm"])):
        diffs = [
            f"{_rel(curves[lab]['loss'][i], loss):.2e} / {_rel(curves[lab]['grad_norm'][i], gnorm):.2e}"
            for lab in labels[1:]
        ]
        lines.append(" | ".join([str(i + 1), f"{loss:.6f}", f"{gnorm:.6f}", *diffs]))
    worst = compare(curves)
    lines.append("")
    for lab in labels[1:]:
        verdict = "ok" if worst[lab] <= rtol else "MISMATCH"
        lines.append(f"{lab}: max rel diff {worst[lab]:.2e} over loss and grad norm ({verdict}, rtol {rtol:g})")
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
    layouts, overrides = split_overrides(layouts, overrides)
    if len(layouts) < 2:
        raise ConfigError("tessera parity needs at least two --layouts to compare (e.g. single dp_shard=2)")
    parsed = [parse_layout(spec) for spec in layouts]
    root = Path(work_dir or tempfile.mkdtemp(prefix="tessera-parity-"))
    curves = {}
    for i, layout in enumerate(parsed):
        curves[layout.label] = run_layout(layout, config, overrides, steps, root / f"layout{i}")
    worst = compare(curves)
    return format_table(curves, rtol), all(v <= rtol for v in worst.values())
