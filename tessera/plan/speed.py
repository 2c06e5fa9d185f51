"""Predicted step time of a layout: compute, exposed communication, pipeline bubble.

- **Compute**: the FLOPs each GPU runs per step -- 6 x (its share of the matmul parameters) per
  token plus 12 x H x Q x T per token and layer for attention scores (tessera's MFU formula,
  with attention counted at matmul speed), plus the forward again for recomputed blocks --
  divided by ``peak x efficiency`` (the calibrated per-GPU factor of :mod:`tessera.plan.gpus`).
  Under tessera's TP plan an MoE layer runs replicated on every tp rank; expert parallelism
  splits the experts' work.
- **Communication** (ring collectives at ``LINK_EFFICIENCY`` of the link, NVLink inside a
  node, the network across nodes; the mesh is ``(pp, dp_replicate, dp_shard, cp, tp)`` with tp
  innermost): TP/SP collectives (two regions per block, each way, again when recomputed) are
  exposed; expert all-to-alls (dispatch and combine, each way) are exposed; pipeline
  point-to-point transfers are exposed; context-parallel K/V exchange hides behind attention
  compute; FSDP all-gathers/reduce-scatters and DDP all-reduces hide behind the same
  micro-batch's compute, except what exceeds it and one block's worth (the first gather, the
  last reduction).
- **Bubble**: ``(p - 1) / v`` micro-batch times of the slowest rank (``(p-1)/(m+p-1)`` of the
  step for 1F1B and GPipe), a third of that for the zero-bubble schedule (its weight-gradient
  work fills two thirds of the idle slots when F, B and W take equal time).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tessera import registry
from tessera.plan.activations import Precision, tessera_precision
from tessera.plan.gpus import GPU, LATENCY_NETWORK, LATENCY_NVLINK, LINK_EFFICIENCY
from tessera.plan.layouts import Layout
from tessera.plan.memory import RankShare, block_memory, rank_share
from tessera.plan.shapes import BlockParams, ModelShape


@dataclass(frozen=True)
class Engine:
    """How the training engine schedules its data-parallel gradient reduction."""

    name: str = "tessera"
    reduce_every_microbatch: bool = True  # tessera's grad_accum loop reduces each micro-batch (no no_sync)
    reduce_bytes: int = 4  # gradient reduction dtype
    compute_bytes: int = 2  # activations and gathered parameters on the wire
    dp_overlap: bool = True  # gradient reduction overlaps backward (Megatron-LM 2021's local DDP reduced after it)
    pp_scatter_gather: bool = (
        False  # pipeline sends 1/tp of each activation (Megatron's scatter-gather); SP does anyway
    )


TESSERA = Engine()


@dataclass(frozen=True)
class Speed:
    """Seconds per optimizer step and what they buy."""

    compute: float
    comm: float  # exposed communication
    bubble: float
    optimizer: float
    tokens_per_step: float
    world: int
    model_flops_per_step: float
    peak_flops: float

    @property
    def step(self) -> float:
        """Seconds per optimizer step."""
        return self.compute + self.comm + self.bubble + self.optimizer

    @property
    def tokens_per_s_per_gpu(self) -> float:
        """Trained tokens per second per GPU."""
        return self.tokens_per_step / self.step / self.world

    @property
    def mfu(self) -> float:
        """Model FLOPs utilization: model FLOPs (no recompute) per second over the peak."""
        return self.model_flops_per_step / self.step / self.world / self.peak_flops

    @property
    def tflops_per_gpu(self) -> float:
        """Achieved model TFLOP/s per GPU."""
        return self.model_flops_per_step / self.step / self.world / 1e12


def _link(gpu: GPU, stride: int, size: int) -> tuple[float, float]:
    """(bandwidth, latency) of a group of ``size`` ranks ``stride`` apart: NVLink if it fits in a node."""
    if stride * size <= gpu.gpus_per_node:
        return gpu.nvlink * LINK_EFFICIENCY, LATENCY_NVLINK
    return gpu.network * LINK_EFFICIENCY, LATENCY_NETWORK


def ring_time(kind: str, nbytes: float, size: int, link: tuple[float, float]) -> float:
    """Seconds of one ring collective over ``size`` ranks moving a ``nbytes`` tensor."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    bandwidth, latency = link
    factor = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0, "p2p": size / (size - 1)}[
        kind
    ]
    return factor * (size - 1) / size * nbytes / bandwidth + latency


def _recomputed(layout: Layout, index: int) -> bool:
    return layout.ac == "full" or (layout.ac == "selective" and index % layout.ac_every == 0)


def _score_flops(shape: ModelShape, block: BlockParams, seq_len: int) -> float:
    """The attention-score term of tessera's MFU formula for this block's mixer: its registered spec's
    (an attention layer's kernel's; Mamba's scan is counted by its matmul parameters alone)."""
    return registry.get("mixer", block.mixer).terms.flops(shape.cfg, seq_len)


def _block_flops(shape: ModelShape, block: BlockParams, layout: Layout, seq_len: int) -> float:
    """Training FLOPs per token of one block on one GPU (without recompute)."""
    attention = _score_flops(shape, block, seq_len) / layout.tp
    dense = 6.0 * block.tp / layout.tp
    if not block.moe:
        return dense + attention + 6.0 * block.replicated
    routed = 6.0 * shape.top_k * block.experts / shape.experts
    # Without EP every tp rank runs the whole MoE layer for its tokens; EP splits the experts' work.
    return dense + attention + 6.0 * block.replicated + routed


def _elementwise_bytes(
    shape: ModelShape, block: BlockParams, prec: Precision, layout: Layout, tokens: int, keys: int
) -> float:
    """Bytes op-level checkpointing recomputes in a block: what full saving keeps beyond the matmul outputs."""
    mem = block_memory(shape, block, prec)
    tp, sp = layout.tp, layout.sequence_parallel
    return max(0.0, mem.full.bytes(tokens, keys, tp, sp) - mem.op.bytes(tokens, keys, tp, sp))


@dataclass(frozen=True)
class _RankTime:
    compute: float  # seconds per micro-batch
    comm: float  # exposed seconds per micro-batch (TP, CP, EP, PP)


def _rank_time(
    shape: ModelShape, share: RankShare, layout: Layout, seq_len: int, gpu: GPU, engine: Engine, prec: Precision
) -> _RankTime:
    """Compute and exposed model-parallel communication of one micro-batch on one pp rank."""
    tokens = layout.micro_batch * seq_len / layout.cp
    rate = (gpu.fp32_flops if prec.compute == 4 else gpu.peak_flops) * gpu.efficiency
    c, h = engine.compute_bytes, shape.dim
    tp_link = _link(gpu, 1, layout.tp)
    region = 2 * ring_time(
        "reduce_scatter" if layout.sequence_parallel else "all_reduce", tokens * h * c, layout.tp, tp_link
    )
    if not layout.sequence_parallel:
        region /= 2
    kv_bytes = 2 * tokens * layout.cp * shape.n_kv_heads * shape.head_dim / layout.tp * c
    cp_link, ep_link = _link(gpu, layout.tp, layout.cp), _link(gpu, layout.tp, layout.ep)
    compute = comm = 0.0
    for stage in share.stages:
        for i, block in enumerate(stage):
            flops = _block_flops(shape, block, layout, seq_len) * tokens
            extra = _recomputed(layout, i)
            compute += flops * (4 / 3 if extra else 1.0) / rate
            if layout.ac == "op":  # recomputing the elementwise ops: memory-bound, read and write what they make
                compute += 2 * _elementwise_bytes(shape, block, prec, layout, int(tokens), seq_len) / gpu.hbm_bandwidth
            comm += (4 + (2 if extra else 0)) * region
            attention = _score_flops(shape, block, seq_len) * tokens
            attention /= layout.tp * rate
            comm += max(0.0, 3 * ring_time("all_gather", kv_bytes, layout.cp, cp_link) - attention)
            if block.moe:
                comm += (4 + (2 if extra else 0)) * ring_time(
                    "all_to_all", tokens * shape.top_k * h * c, layout.ep, ep_link
                )
    if share.head:
        compute += 6.0 * shape.head_matmul / layout.tp * tokens / rate
        comm += 2 * region
    if share.embedding:
        comm += 2 * region
    if layout.pp > 1:
        pp_link = _link(gpu, layout.world // layout.pp, 2)
        split = layout.tp if layout.sequence_parallel or engine.pp_scatter_gather else 1
        comm += 2 * layout.virtual * ring_time("p2p", tokens * h * c / split, 2, pp_link)
    return _RankTime(compute, comm)


def _dp_time(local: float, layout: Layout, gpu: GPU, engine: Engine, n_blocks: int) -> tuple[float, float]:
    """(seconds of data-parallel collectives per micro-batch, per step) on one GPU, before overlap."""
    c, r = engine.compute_bytes, engine.reduce_bytes
    shard_link = _link(gpu, layout.tp, layout.shard)
    rep_link = _link(gpu, layout.tp * layout.shard, layout.dp_replicate)
    per_micro = per_step = 0.0
    if layout.fsdp:
        gathers = (2 if layout.reshard else 1) * ring_time("all_gather", c * local, layout.shard, shard_link)
        reduce = ring_time("reduce_scatter", r * local, layout.shard, shard_link)
        reduce += ring_time("all_reduce", r * local / layout.shard, layout.dp_replicate, rep_link)
        if layout.pp > 1:  # the pipeline keeps parameters gathered and reduces once, after the last micro-batch
            per_step = ring_time("all_gather", c * local, layout.shard, shard_link) + reduce
        else:
            per_micro = gathers + (reduce if engine.reduce_every_microbatch else 0.0)
            per_step = 0.0 if engine.reduce_every_microbatch else reduce
    elif layout.dp_replicate > 1:
        reduce = ring_time("all_reduce", r * local, layout.dp_replicate, rep_link)
        per_micro, per_step = (reduce, 0.0) if engine.reduce_every_microbatch and layout.pp == 1 else (0.0, reduce)
    return per_micro, per_step


def estimate_speed(
    shape: ModelShape,
    layout: Layout,
    seq_len: int,
    global_batch: int,
    gpu: GPU,
    engine: Engine = TESSERA,
    layers_per_stage: str = "",
    prec: Precision | None = None,
) -> Speed:
    """Seconds per optimizer step of ``layout`` on ``gpu``, split into compute, exposed comm, bubble, optimizer."""
    ranks = [rank_share(shape, layout, r, layers_per_stage, seq_len) for r in sorted({0, layout.pp - 1})]
    prec = prec or tessera_precision("bf16", layout.fsdp)
    engine = dataclasses.replace(engine, compute_bytes=prec.compute)  # activations and gathers travel in it
    times = [_rank_time(shape, s, layout, seq_len, gpu, engine, prec) for s in ranks]
    slow = max(range(len(times)), key=lambda i: times[i].compute + times[i].comm)
    t, share = times[slow], ranks[slow]
    m = layout.microbatches
    local = share.local(shape, layout)
    n_blocks = max(1, sum(len(s) for s in share.stages))
    dp_micro, dp_step = _dp_time(local, layout, gpu, engine, n_blocks)
    # DP collectives hide behind the micro-batch's compute except the excess and one block's worth.
    exposed_micro = max(0.0, dp_micro - t.compute) + dp_micro / n_blocks
    backward = t.compute * 2 / 3
    exposed_step = max(0.0, dp_step - backward) + dp_step / n_blocks if engine.dp_overlap else dp_step
    compute, comm = m * t.compute, m * (t.comm + exposed_micro) + exposed_step
    bubble = 0.0
    if layout.pp > 1:
        bubble = (layout.pp - 1) / layout.virtual * (t.compute + t.comm)
        if layout.schedule == "interleaved_zb":
            bubble /= 3
    optimizer = 32.0 * local / (layout.shard if layout.fsdp else 1) / gpu.hbm_bandwidth
    tokens = global_batch * seq_len
    return Speed(
        compute, comm, bubble, optimizer, tokens, layout.world, shape.flops_per_token(seq_len) * tokens, gpu.peak_flops
    )
