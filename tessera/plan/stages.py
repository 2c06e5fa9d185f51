"""Blocks per pipeline stage for a whole job: ``parallel.layers_per_stage="cost"`` resolved with the
planner's per-block FLOPs, and the banner line that says how the stages were cut."""

from __future__ import annotations

from tessera.config import JobConfig
from tessera.layout import COST_SPLIT, microbatches, pipeline_blocks, stage_layer_counts, virtual_stages
from tessera.plan.shapes import cost_split, model_shape


def stage_split(config: JobConfig) -> str:
    """``parallel.layers_per_stage`` as block counts: "cost" resolved for this model and sequence length,
    an explicit list as given, "" (balanced by count) as is."""
    p = config.parallel
    if p.layers_per_stage != COST_SPLIT:
        return p.layers_per_stage
    return cost_split(model_shape(config.model), config.train.seq_len, p.pp * virtual_stages(p))


def describe_stages(config: JobConfig) -> str:
    """One line for the banner: the pipeline's ranks, stages, blocks per stage and how they were chosen."""
    p = config.parallel
    n_stages = p.pp * virtual_stages(p)
    counts = stage_layer_counts(pipeline_blocks(config.model), n_stages, stage_split(config))
    how = {"": "even counts", COST_SPLIT: "balanced FLOPs, head on the last"}.get(p.layers_per_stage, "given")
    return (
        f"pipeline: {p.pp} ranks x {n_stages // p.pp} stages, blocks per stage {','.join(map(str, counts))} "
        f"({how}; parallel.layers_per_stage), {p.pp_schedule}, {microbatches(p)} micro-batches"
    )
