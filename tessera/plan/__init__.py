"""The planner: will a layout fit, and how fast will it run? (``tessera plan``).

Formulas (:mod:`~tessera.plan.memory`, :mod:`~tessera.plan.speed`) over the model's real
parameter layout (:mod:`~tessera.plan.shapes`), for every layout the compatibility matrix
allows (:mod:`~tessera.plan.layouts`), on a GPU of the catalog (:mod:`~tessera.plan.gpus`);
``--measure`` checks one layout on fake ranks with the real ``parallelize()``
(:mod:`~tessera.plan.measure`).
"""

from __future__ import annotations

import sys

from tessera.config import JobConfig
from tessera.plan.gpus import CATALOG, GIB, gpu, local_gpu_kind
from tessera.plan.planner import Estimate, Plan, estimate, plan, requested_estimate
from tessera.plan.shapes import model_shape

__all__ = ["CATALOG", "Estimate", "Plan", "estimate", "fit_warning", "gpu", "plan", "warn_if_unfit"]


def fit_warning(config: JobConfig, world: int, gpu_name: str, gpus_per_node: int = 8) -> str:
    """One line when ``config`` on ``world`` GPUs of kind ``gpu_name`` is predicted not to fit, else ""."""
    import dataclasses

    kind = dataclasses.replace(gpu(gpu_name), gpus_per_node=gpus_per_node)
    est = requested_estimate(config, model_shape(config.model), world, kind)
    if est is None or est.fits:
        return ""
    return (
        f"tessera: warning: the planner predicts {est.memory.total / GIB:.1f} GiB per GPU for this layout "
        f"({est.memory.moment}), {est.over / GIB:.1f} GiB over the {kind.memory / GIB:.1f} GiB of an {kind.name}; "
        f"`tessera plan CONFIG --gpus {world} --gpu {gpu_name}` lists layouts that fit"
    )


def warn_if_unfit(config: JobConfig, world: int, gpu_name: str, gpus_per_node: int = 8, device: str = "gpu") -> None:
    """Print :func:`fit_warning` to stderr before a launch on ``world`` GPUs.

    The GPU kind is ``gpu_name`` (``--gpu``), else this machine's own CUDA GPU when the catalog knows it; a GPU
    job whose kind is unknown gets a one-line notice that the fit check did not run and how to ask for it.
    """
    kind = gpu_name or local_gpu_kind()
    if kind:
        line = fit_warning(config, world, kind, gpus_per_node)
        if line:
            print(line, file=sys.stderr, flush=True)
    elif device == "gpu":
        print(
            f"tessera: notice: the planner's fit check did not run (GPU kind unknown); pass --gpu "
            f"{'|'.join(CATALOG)} to check this layout fits {world} of them",
            file=sys.stderr,
            flush=True,
        )
