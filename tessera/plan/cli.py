"""``tessera plan CONFIG --gpus N --gpu KIND``: checks of the flags, the plan, the report."""

from __future__ import annotations

import dataclasses
import sys

from tessera.validate import load_config
from tessera.errors import ConfigError
from tessera.plan.gpus import gpu
from tessera.plan.layouts import apply_layout
from tessera.plan.measure import measure_layout
from tessera.plan.planner import MAX_LAYOUTS, Estimate, Plan, plan
from tessera.plan.report import render


def measurable(e: Estimate, p: Plan) -> bool:
    """Whether ``--measure`` can run this layout on fake ranks (decoder, no pipeline, no MoE)."""
    return p.config.model.arch == "decoder" and e.layout.pp == 1 and not p.config.model.moe.experts


def run_plan(
    config_path: str,
    overrides: list[str],
    gpus: int,
    gpu_name: str,
    gpus_per_node: int = 8,
    top: int = 10,
    measure: bool = False,
    max_layouts: int = MAX_LAYOUTS,
) -> str:
    """The report of ``tessera plan`` (and, with ``measure``, the best measurable layout measured)."""
    flags = (("--gpus", gpus), ("--nodes-of", gpus_per_node), ("--top", top), ("--max-layouts", max_layouts))
    for flag, value in flags:
        if value < 1:
            raise ConfigError(f"{flag} must be positive, got {value}")
    config = load_config(config_path, overrides)
    kind = dataclasses.replace(gpu(gpu_name), gpus_per_node=gpus_per_node)
    result = plan(config, gpus, kind, max_layouts, lambda line: print(line, file=sys.stderr, flush=True))
    measured = None
    if measure:
        candidates = [e for e in result.estimates if e.fits and measurable(e, result)][:1]
        if not candidates:
            raise ConfigError(
                "--measure needs a fitting layout without pipeline parallelism or MoE (a decoder); none was found"
            )
        best = candidates[0]
        measured = (best, measure_layout(apply_layout(config, best.layout), gpus))
    return render(result, config_path, top, measured, overrides)
