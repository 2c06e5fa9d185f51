"""Plan a job: enumerate layouts, estimate each one's memory and speed, rank them."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from tessera.config import ConfigError, JobConfig
from tessera.layout import check_layout
from tessera.plan.activations import tessera_precision
from tessera.plan.gpus import ALLOCATOR_SLACK, GPU, RUNTIME_OVERHEAD
from tessera.plan.layouts import Layout, candidate_layouts, global_batch, layout_of, layout_problem, stage_split_for
from tessera.plan.memory import MemoryBreakdown, OptimizerState, Setting, estimate_memory
from tessera.plan.shapes import ModelShape, model_shape
from tessera.plan.speed import TESSERA, Engine, Speed, estimate_speed


@dataclass(frozen=True)
class Estimate:
    """One layout's predicted memory and speed on one GPU kind."""

    layout: Layout
    memory: MemoryBreakdown
    speed: Speed
    capacity: float

    @property
    def fits(self) -> bool:
        """Whether the predicted peak fits in the GPU's memory."""
        return self.memory.total <= self.capacity

    @property
    def over(self) -> float:
        """Bytes beyond the GPU's memory (negative: headroom)."""
        return self.memory.total - self.capacity


@dataclass(frozen=True)
class Plan:
    """The ranked estimates of a job on ``world`` GPUs of one kind."""

    config: JobConfig
    shape: ModelShape
    gpu: GPU
    world: int
    estimates: list[Estimate]
    requested: Estimate | None  # the layout the config itself asks for, when tessera would run it
    cut: str = ""  # what the search left out when it stopped at its cap ("" = every layout was estimated)


def estimate(config: JobConfig, shape: ModelShape, layout: Layout, gpu: GPU, engine: Engine = TESSERA) -> Estimate:
    """Memory (with the GPU runtime's overhead) and speed of ``layout`` for this job."""
    setting = job_setting(config, layout)
    memory = estimate_memory(shape, layout, setting, RUNTIME_OVERHEAD, ALLOCATOR_SLACK)
    speed = estimate_speed(
        shape, layout, config.train.seq_len, global_batch(config), gpu, engine, setting.layers_per_stage, setting.prec
    )
    return Estimate(layout, memory, speed, gpu.memory)


def job_setting(config: JobConfig, layout: Layout, device: str = "cuda") -> Setting:
    """What besides ``layout`` decides its memory, as ``config`` sets it: precisions, the loss (the fused head
    and loss in chunks of ``train.loss_chunk_tokens`` where the trainer fuses it: the torch engine, no
    distillation, not an encoder-decoder's pipeline stages) and the optimizer's state (``optim.name``,
    ``optim.state_dtype``)."""
    from tessera.train.loss import chunk_tokens

    train, optim = config.train, config.optim
    staged_encoder_decoder = layout.pp > 1 and config.model.arch == "encoder_decoder"
    fused = train.fused_loss and config.parallel.engine == "torch" and not train.distill.teacher
    fused = fused and not staged_encoder_decoder
    return Setting(
        tessera_precision(train.dtype, layout.fsdp),
        train.seq_len,
        device,
        stage_split_for(config, layout),
        chunk_tokens(config.model.vocab_size, 1 << 62, train.loss_chunk_tokens) if fused else 0,
        OptimizerState(
            optim.name,
            2 if optim.state_dtype == "bf16" else 4,
            2 if optim.muon.ns_dtype == "bf16" else 4,
            "fused" if optim.implementation == "auto" else optim.implementation,  # auto: fused on CPU and CUDA
        ),
    )


# Among layouts about this close in speed, the one leaving more memory free ranks first.
MEMORY_PREFERENCE = 0.02


def rank_key(e: Estimate) -> tuple[int, float]:
    """Fitting layouts first, fastest first (discounted by up to 2% for the memory they use); then
    the rest, closest to fitting first."""
    if not e.fits:
        return (1, e.over)
    return (0, -e.speed.tokens_per_s_per_gpu * (1 - MEMORY_PREFERENCE * e.memory.total / e.capacity))


# Typical searches estimate up to ~90,000 layouts (llama3-70b on 1,024 GPUs); a million GPUs with a huge batch
# offer millions, which would take an hour. The search stops here and the report says so.
MAX_LAYOUTS = 200_000
PROGRESS_EVERY_S = 5.0


def _search(
    config: JobConfig, shape: ModelShape, world: int, gpu: GPU, max_layouts: int, progress: Callable[[str], None]
) -> tuple[list[Estimate], str]:
    """The estimates of the first ``max_layouts`` candidate layouts, and what was cut ("" if nothing)."""
    estimates: list[Estimate] = []
    started = last = time.monotonic()
    for layout in candidate_layouts(config, world, gpu.gpus_per_node):
        if len(estimates) == max_layouts:
            return estimates, (
                f"the search stopped at its cap of {max_layouts:,} layouts (more exist for {world:,} GPUs); the "
                "ranking covers those only: fix some degrees (parallel.tp=8 ...) or raise --max-layouts"
            )
        estimates.append(estimate(config, shape, layout, gpu))
        if time.monotonic() - last >= PROGRESS_EVERY_S:
            last = time.monotonic()
            progress(f"plan: {len(estimates):,} layouts estimated in {last - started:.0f}s (cap {max_layouts:,})")
    return estimates, ""


def plan(
    config: JobConfig,
    world: int,
    gpu: GPU,
    max_layouts: int = MAX_LAYOUTS,
    progress: Callable[[str], None] = lambda line: None,
) -> Plan:
    """The layouts of ``world`` GPUs tessera would run for ``config`` (at most ``max_layouts``), estimated and
    ranked; ``progress`` gets a line every few seconds of a long search."""
    if world < 1:
        raise ConfigError(f"--gpus must be positive, got {world}")
    shape = model_shape(config.model)
    estimates, cut = _search(config, shape, world, gpu, max_layouts, progress)
    if not estimates:
        raise ConfigError(
            f"no layout of {world} GPUs passes tessera's checks for this job; "
            f"train.batch_size * train.grad_accum = {global_batch(config)} must divide by the data-parallel degree"
        )
    estimates.sort(key=rank_key)
    return Plan(config, shape, gpu, world, estimates, requested_estimate(config, shape, world, gpu), cut)


def requested_estimate(config: JobConfig, shape: ModelShape, world: int, gpu: GPU) -> Estimate | None:
    """The estimate of the layout the config asks for on ``world`` GPUs (None if tessera would refuse it)."""
    try:
        check_layout(config, world)  # the job as written (its own batch split), before it is re-expressed as a Layout
        layout = layout_of(config, world)
    except (ConfigError, ZeroDivisionError):
        return None
    if layout_problem(config, layout, world):
        return None
    return estimate(config, shape, layout, gpu)
