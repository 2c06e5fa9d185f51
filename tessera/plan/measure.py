"""Measure a layout's per-GPU memory without GPUs: the real model, the real ``parallelize()``.

``measure_layout`` joins a *fake* process group of the layout's world size (collectives return
at once, nothing is sent), builds the zoo model on the meta device, applies tessera's own
``parallelize()`` (TP/SP, activation checkpointing, FSDP/HSDP) exactly as ``tessera train``
does, materializes it as fake tensors (shapes and dtypes, no storage) and runs two training
steps of random tokens -- the trainer's forward, loss, backward, clipping and AdamW step --
under torch's memory tracker (``FSDPMemTracker`` with FSDP, else ``MemTracker``), which adds
up every tensor storage alive at each moment. A 70B layout's per-GPU peak is measured on a
laptop in seconds to minutes.

``training_memory`` is the same loop on an already built model; ``benchmarks/memory.py`` runs
it on real CPU processes (gloo, real tensors) to check both the planner and this measurement.

Not measured here: DDP's C++ reducer cannot run on fake tensors, so a DDP layout is measured as
one replica plus its gradient buckets (4 bytes per parameter); pipeline schedules need real
point-to-point messages, so pp > 1 is refused (measure real pp runs with benchmarks/memory.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from tessera.config import JobConfig
from tessera.dtypes import DTYPES
from tessera.errors import ConfigError


@dataclass(frozen=True)
class Measurement:
    """Peak bytes of one rank over a training step, by the tracker's categories."""

    peak: float
    categories: dict[str, float]
    seconds: float
    note: str = ""


@dataclass(frozen=True)
class StepSpec:
    """How the trainer runs a step for this layout."""

    dp: int  # data-parallel degree (splits the global batch)
    fsdp: bool  # FSDP's mixed precision instead of autocast
    tp: bool  # loss parallelism
    pipeline: object = None  # tessera.parallel.pipeline.Pipeline when pp > 1
    pp_mesh: object = None
    clip: bool = True  # gradient clipping (its norm is a data-dependent scalar: off on fake tensors)


def _step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: JobConfig,
    tokens: torch.Tensor,
    spec: StepSpec,
    after_micro=lambda: None,
) -> None:
    """One optimizer step as the trainer takes it, on ``tokens`` (grad_accum, B, T + 1): the head fused into
    the loss with ``train.fused_loss`` (outside a pipeline), else the plain loss on whole logits."""
    from torch.distributed.tensor.parallel import loss_parallel

    from tessera.model.moe import MoELog, moe_loss
    from tessera.parallel import clip_grad_norm
    from tessera.parallel.loss import LossWeights, MicroBatch, combine_losses
    from tessera.train.loss import FusedHeadLoss, lm_loss

    dtype = DTYPES[config.train.dtype]
    autocast = (
        torch.autocast(tokens.device.type, dtype=dtype)
        if dtype != torch.float32 and not spec.fsdp
        else contextlib.nullcontext()
    )
    accum, train = config.train.grad_accum, config.train
    fused = train.fused_loss and spec.pipeline is None  # as the trainer: pipeline stages keep the plain loss
    for micro in tokens:
        inputs, labels = micro[:, :-1], micro[:, 1:]
        with loss_parallel() if spec.tp and not fused else contextlib.nullcontext():
            if spec.pipeline is not None:
                with autocast:
                    spec.pipeline.step(MicroBatch((inputs,), {}, labels), accum)
                after_micro()
                continue
            log = MoELog()
            with autocast:
                if fused:
                    head = FusedHeadLoss(labels, None, train.label_smoothing, train.loss_chunk_tokens)
                    loss = model(inputs, moe_log=log, output_fn=head)
                else:
                    logits = model(inputs, moe_log=log)
            if not fused:
                loss = lm_loss(logits, labels, train.label_smoothing)
            aux = moe_loss(log)
            loss = combine_losses(loss, LossWeights(), aux=aux) / accum  # the trainer's terms (no MTP here)
            loss.backward()
        after_micro()
    if spec.clip:
        clip_grad_norm(model.parameters(), config.optim.grad_clip or float("inf"), spec.pp_mesh)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def training_memory(
    model: nn.Module, config: JobConfig, spec: StepSpec, steps: int = 2
) -> tuple[float, dict[str, float]]:
    """Peak tracked bytes (and their categories) of ``steps`` training steps after one warm-up step.

    The warm-up step (untracked) creates the optimizer state and whatever else is built lazily,
    so the peak is the steady state's.
    """
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    from tessera.train.optim import build_optimizer

    optimizer = build_optimizer(model, config.optim)
    local = config.train.batch_size // spec.dp
    shape = (config.train.grad_accum, local, config.train.seq_len + 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _step(model, optimizer, config, torch.randint(0, config.model.vocab_size, shape), spec)
        if spec.pipeline is not None:
            tracker = _peak_tracker()
        else:
            tracker = FSDPMemTracker(model, optimizer) if spec.fsdp else MemTracker()
        if spec.pipeline is not None or not spec.fsdp:
            tracker.track_external(model, optimizer)
        with tracker:
            for _ in range(steps):
                _step(
                    model,
                    optimizer,
                    config,
                    torch.randint(0, config.model.vocab_size, shape),
                    spec,
                    tracker.reset_mod_stats,
                )
    snapshot = tracker.get_tracker_snapshot("peak")
    categories: dict[str, float] = {}
    for device_snapshot in snapshot.values():
        for kind, value in device_snapshot.items():
            name = str(getattr(kind, "value", kind))
            categories[name] = categories.get(name, 0.0) + float(value)
    return categories.pop("Total", 0.0), categories


def _peak_tracker():
    """A ``MemTracker`` without per-module statistics, which refuse a module called several times per step
    (a pipeline stage runs once per micro-batch); the storage accounting, and so the peak, is the same."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class PeakTracker(MemTracker):
        def _pre_fw_hook(self, module, inputs):
            pass

        def _post_fw_hook(self, module, inputs, outputs):
            pass

        def _pre_bw_hook(self, module, args):
            pass

        def _post_bw_hook(self, module, args):
            pass

    return PeakTracker()


@contextlib.contextmanager
def _untracked_loss_parallel_metadata():
    """Hide loss parallelism's global-shape metadata pass from the tracker.

    ``loss_parallel``'s backward infers the output metadata by running the op on full-vocabulary
    shapes; on real tensors that runs under DTensor's own fake mode and is not tracked, but
    inside our fake mode the tracker would count those full-size temporaries as memory.
    """
    from torch.distributed.tensor.parallel import loss
    from torch.utils._python_dispatch import _disable_current_modes

    original = loss._propagate_tensor_meta

    def untracked(*args, **kwargs):
        with _disable_current_modes():
            return original(*args, **kwargs)

    loss._propagate_tensor_meta = untracked
    try:
        yield
    finally:
        loss._propagate_tensor_meta = original


@contextlib.contextmanager
def fake_world(world: int, rank: int = 0):
    """A fake process group of ``world`` ranks seen from ``rank`` (collectives do nothing)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group already exists; measure in a fresh process")
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def measure_layout(config: JobConfig, world: int, rank: int = 0, steps: int = 1) -> Measurement:
    """Per-GPU peak memory of ``config`` on ``world`` fake ranks, measured on fake tensors.

    Gradient accumulation is cut to two micro-batches: from the second on, each micro-batch
    meets the same memory (the earlier micro-batches' gradients), so more only cost time.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tessera.model import build_model
    from tessera.parallel import ParallelDims, parallelize, uses_fsdp

    if config.model.arch != "decoder":
        raise ConfigError(
            f"--measure runs causal-LM steps; model.arch='{config.model.arch}' is planned by formula only"
        )
    if config.model.moe.experts:
        raise ConfigError(
            "--measure cannot route MoE tokens on fake tensors (data-dependent shapes); "
            "measure MoE layouts on real processes with benchmarks/memory.py"
        )
    if config.parallel.pp > 1:
        raise ConfigError(
            "--measure cannot run pipeline schedules on a fake process group; measure pp > 1 with benchmarks/memory.py"
        )
    start = time.perf_counter()
    if config.train.grad_accum > 2:
        config = dataclasses.replace(config, train=dataclasses.replace(config.train, grad_accum=2))
    dims = ParallelDims.from_config(config.parallel, world)
    note, buckets = "", 0.0
    if dims.dp_replicate > 1 and not uses_fsdp(dims):  # DDP: one replica, plus the reducer's buckets
        parallel = dataclasses.replace(config.parallel, dp_replicate=1)
        train = dataclasses.replace(config.train, batch_size=config.train.batch_size // dims.dp_replicate)
        config = dataclasses.replace(config, parallel=parallel, train=train)
        world //= dims.dp_replicate
        dims = ParallelDims.from_config(config.parallel, world)
        note = "DDP measured as one replica plus 4 bytes per parameter of gradient buckets"
    with fake_world(world, rank):
        if world > 1:
            dims.build_mesh("cpu")
        with torch.device("meta"):
            model = build_model(config.model)
        # Mesh arithmetic must run on real tensors: parallelize the meta model, then materialize it fake.
        model = parallelize(model, dims, config)
        with FakeTensorMode(allow_non_fake_inputs=True), _untracked_loss_parallel_metadata():
            model.to_empty(device="cpu")
            if note:
                buckets = 4.0 * sum(p.numel() for p in model.parameters())
            spec = StepSpec(dims.dp, uses_fsdp(dims), dims.tp > 1, clip=False)
            peak, categories = training_memory(model, config, spec, steps)
    if buckets:
        categories["DDP buckets"] = buckets
    return Measurement(peak + buckets, categories, time.perf_counter() - start, note)
