"""Parallel layouts the planner considers, and their enumeration under the compatibility matrix.

A :class:`Layout` fixes every degree (dp_replicate, dp_shard, tp, pp, cp, ep), sequence
parallelism, the pipeline schedule and its virtual stages, activation checkpointing, FSDP's
resharding, and how each data-parallel rank splits its share of the global batch into
micro-batches. The global batch (``train.batch_size * train.grad_accum`` sequences per optimizer
step) never changes: a layout only chooses how it is cut. A candidate is kept when the job it
describes passes tessera's own checks (config validation, which applies the compatibility
matrix, and the world-size checks), so the planner never proposes what ``tessera train`` refuses.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from tessera.config import JobConfig
from tessera.data.rules import check_objective_split
from tessera.errors import ConfigError
from tessera.layout import (
    COST_SPLIT,
    check_layout,
    data_parallel_degree,
    microbatches,
    resolve_dp_shard,
    virtual_stages,
    world_size_of,
)
from tessera.plan.shapes import divisors

AC_MODES = ("none", "op", "selective", "full")
PP_SCHEDULES = (("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4), ("interleaved_zb", 2))
MAX_MICRO_BATCH = 16


@dataclass(frozen=True)
class Layout:
    """One complete way to run a job on ``world`` processes."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    sp: bool = True  # sequence parallelism (with tp > 1)
    schedule: str = "1f1b"
    virtual: int = 1  # pipeline stages per pp rank
    micro_batch: int = 1  # sequences per micro-batch on each data-parallel rank
    microbatches: int = 1  # micro-batches per optimizer step on each data-parallel rank
    ac: str = "none"
    ac_every: int = 2
    reshard: bool = True  # FSDP reshard_after_forward (False: ZeRO-2-style memory)

    @property
    def world(self) -> int:
        """Processes the layout needs."""
        return world_size_of(self)

    @property
    def dp(self) -> int:
        """Data-parallel degree (different batches at once)."""
        return data_parallel_degree(self)

    @property
    def shard(self) -> int:
        """Degree parameters are sharded over (FSDP over dp_shard x cp)."""
        return self.dp_shard * self.cp

    @property
    def fsdp(self) -> bool:
        """Whether FSDP shards parameters (tessera's ``uses_fsdp``)."""
        return self.shard > 1

    @property
    def sequence_parallel(self) -> bool:
        """Sequence parallelism in effect (needs tp > 1)."""
        return self.sp and self.tp > 1

    def describe(self) -> str:
        """A short label: the degrees above 1, the schedule, AC and micro-batching."""
        parts = [
            f"{k}={v}"
            for k, v in (
                ("dp_rep", self.dp_replicate),
                ("dp_shard", self.dp_shard),
                ("tp", self.tp),
                ("pp", self.pp),
                ("cp", self.cp),
                ("ep", self.ep),
            )
            if v > 1
        ]
        if self.tp > 1 and not self.sp:
            parts.append("no-sp")
        if self.pp > 1:
            parts.append(self.schedule + (f"/v{self.virtual}" if self.virtual > 1 else ""))
        if self.fsdp and not self.reshard:
            parts.append("zero2")
        return " ".join(parts or ["single"])

    def overrides(self, global_batch: int) -> list[str]:
        """The ``section.key=value`` overrides that make a recipe run this layout."""
        p = [
            f"parallel.dp_replicate={self.dp_replicate}",
            f"parallel.dp_shard={self.dp_shard}",
            f"parallel.tp={self.tp}",
            f"parallel.pp={self.pp}",
            f"parallel.cp={self.cp}",
            f"parallel.ep={self.ep}",
            f"parallel.activation_checkpoint={self.ac}",
        ]
        if self.tp > 1:
            p.append(f"parallel.sequence_parallel={str(self.sp).lower()}")
        if self.ac == "selective":
            p.append(f"parallel.ac_every={self.ac_every}")
        if self.fsdp:
            p.append(f"parallel.reshard_after_forward={str(self.reshard).lower()}")
        if self.pp > 1:
            p += [
                f"parallel.pp_schedule={self.schedule}",
                f"parallel.pp_virtual_stages={self.virtual}",
                f"parallel.microbatches={self.microbatches}",
                f"train.batch_size={global_batch}",
                "train.grad_accum=1",
            ]
        else:
            p += [f"train.batch_size={self.dp * self.micro_batch}", f"train.grad_accum={self.microbatches}"]
        return p


def global_batch(config: JobConfig) -> int:
    """Sequences per optimizer step: ``train.batch_size * train.grad_accum``."""
    return config.train.batch_size * config.train.grad_accum


def stage_split_for(config: JobConfig, layout: Layout) -> str:
    """``parallel.layers_per_stage`` for ``layout``: "cost" fits any split; an explicit list only the
    job's own number of stages (another is balanced by count)."""
    split = config.parallel.layers_per_stage
    if split == COST_SPLIT or layout.pp * layout.virtual == config.parallel.pp * virtual_stages(config.parallel):
        return split
    return ""


def apply_layout(config: JobConfig, layout: Layout) -> JobConfig:
    """A copy of ``config`` that runs ``layout`` (same global batch)."""
    g = global_batch(config)
    parallel = dataclasses.replace(
        config.parallel,
        dp_replicate=layout.dp_replicate,
        dp_shard=layout.dp_shard,
        tp=layout.tp,
        pp=layout.pp,
        cp=layout.cp,
        ep=layout.ep,
        sequence_parallel=layout.sp,
        pp_schedule=layout.schedule,
        pp_virtual_stages=layout.virtual if layout.pp > 1 else 0,
        microbatches=layout.microbatches if layout.pp > 1 else 0,
        activation_checkpoint=layout.ac,
        ac_every=layout.ac_every,
        reshard_after_forward=layout.reshard,
        layers_per_stage=stage_split_for(config, layout),
    )
    if layout.pp > 1:
        train = dataclasses.replace(config.train, batch_size=g, grad_accum=1)
    else:
        train = dataclasses.replace(
            config.train, batch_size=layout.dp * layout.micro_batch, grad_accum=layout.microbatches
        )
    return dataclasses.replace(config, parallel=parallel, train=train)


def layout_of(config: JobConfig, world: int) -> Layout:
    """The layout ``config`` asks for on ``world`` processes (``dp_shard = -1`` resolved)."""
    p = config.parallel
    dp_shard = resolve_dp_shard(p, world)
    dp = data_parallel_degree(p, dp_shard)
    if p.pp > 1:
        mb = microbatches(p)
        micro = max(1, global_batch(config) // (dp * mb))
        return Layout(
            p.dp_replicate,
            dp_shard,
            p.tp,
            p.pp,
            p.cp,
            p.ep,
            p.sequence_parallel,
            p.pp_schedule,
            virtual_stages(p),
            micro,
            mb,
            p.activation_checkpoint,
            p.ac_every,
            p.reshard_after_forward,
        )
    micro = max(1, config.train.batch_size // dp)
    return Layout(
        p.dp_replicate,
        dp_shard,
        p.tp,
        1,
        p.cp,
        p.ep,
        p.sequence_parallel,
        "1f1b",
        1,
        micro,
        config.train.grad_accum,
        p.activation_checkpoint,
        p.ac_every,
        p.reshard_after_forward,
    )


def layout_problem(config: JobConfig, layout: Layout, world: int) -> str:
    """Why tessera would refuse ``layout`` for this job ("" when it would run it)."""
    if layout.world != world:
        return f"the degrees multiply to {layout.world}, not {world}"
    job = apply_layout(config, layout)
    try:
        check_layout(job, world)
        check_objective_split(job.model, job.train, layout.cp)  # span corruption's two lengths under cp
    except ConfigError as err:
        return str(err)
    experts = config.model.moe.experts
    if layout.ep > 1 and (not experts or experts % layout.ep or layout.shard % layout.ep):
        return f"parallel.ep={layout.ep} must divide model.moe.experts={experts} and dp_shard*cp={layout.shard}"
    if layout.cp > 1 and config.train.seq_len % (2 * layout.cp) and config.model.arch != "encoder_decoder":
        return f"train.seq_len={config.train.seq_len} must divide into 2 x cp={2 * layout.cp} chunks"
    return ""


def _degrees(world: int, max_tp: int, moe_experts: int) -> Iterator[tuple[int, int, int, int, int, int]]:
    """(dp_replicate, dp_shard, tp, pp, cp, ep) with product ``world``; tp within a node."""
    for tp in divisors(world):
        if tp > max_tp:
            continue
        for pp in divisors(world // tp):
            for cp in divisors(world // (tp * pp)):
                dp = world // (tp * pp * cp)
                for dp_shard in divisors(dp):
                    eps = [e for e in divisors(dp_shard * cp) if moe_experts % e == 0] if moe_experts else [1]
                    for ep in eps:
                        yield dp // dp_shard, dp_shard, tp, pp, cp, ep


def _micro_choices(per_rank: int, pp: int, schedule: str) -> list[tuple[int, int]]:
    """(micro_batch, microbatches) pairs that cut ``per_rank`` sequences as the schedule allows."""
    out = []
    for b in divisors(per_rank):
        if b > MAX_MICRO_BATCH or b & (b - 1):
            continue
        m = per_rank // b
        if pp > 1 and ((schedule == "1f1b" and m < pp) or (schedule.startswith("interleaved") and m % pp)):
            continue
        out.append((b, m))
    return out


def candidate_layouts(config: JobConfig, world: int, gpus_per_node: int) -> Iterator[Layout]:
    """Every layout of ``world`` processes that tessera would run for this job (tp at most one node)."""
    g = global_batch(config)
    experts = config.model.moe.experts
    for dp_rep, dp_shard, tp, pp, cp, ep in _degrees(world, gpus_per_node, experts):
        dp = dp_rep * dp_shard
        if g % dp:
            continue
        schedules = PP_SCHEDULES if pp > 1 else (("1f1b", 1),)
        for (schedule, v), ac, reshard in itertools.product(
            schedules, AC_MODES, (True, False) if dp_shard * cp > 1 else (True,)
        ):
            for b, m in _micro_choices(g // dp, pp, schedule):
                # Sequence parallelism costs the same communication and saves memory: try without it only if refused.
                layout = Layout(dp_rep, dp_shard, tp, pp, cp, ep, True, schedule, v, b, m, ac, 2, reshard)
                if layout_problem(config, layout, world) and tp > 1:
                    layout = dataclasses.replace(layout, sp=False)
                if not layout_problem(config, layout, world):
                    yield layout
