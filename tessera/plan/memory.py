"""Per-GPU memory of a layout: model states, activations, logits, pipeline in-flight, buffers.

The estimate follows one optimizer step of tessera's trainer and takes the largest of these
moments on the first and the last pipeline rank:

- **loss**: the end of the forward pass and the start of backward -- every saved activation of
  the micro-batches in flight, the logits and their cross-entropy buffers, the parameters FSDP
  holds gathered (or autocast's cast copies), and the gradients of earlier micro-batches;
- **block backward**: the last block's backward (what is still kept, plus its recomputed
  activations and activation gradients, the gathered block and the prefetched next one), and
  an earlier block's backward while the later block's gradients are being reduced;
- **backward end**: all gradients, plus FSDP's unsharded embedding/head gradients awaiting the
  final reduce-scatter;
- **optimizer step**: all gradients plus AdamW's temporaries.

Every constant that is not a formula (the logits' backward buffers, the activation gradients of a
block's backward) was read off torch's memory tracker on tiny decoders, and is named below.

Model states follow the ZeRO paper's accounting (:func:`zero_model_state_bytes`) with tessera's
precisions: fp32 parameters are the master copy, gradients are fp32, AdamW keeps two fp32
moments, so FSDP (ZeRO-3) holds 16P/N bytes and DDP 16P (4P + 4P + 8P: the same total as the
paper's mixed-precision 2P + 2P + 12P, by coincidence of the fp32 master weights), plus what the
layout gathers or casts on top.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

from tessera.layout import COST_SPLIT, stage_layer_counts
from tessera.plan import activations as act
from tessera.plan.activations import BlockMemory, Precision
from tessera.plan.layouts import Layout
from tessera.plan.shapes import BlockParams, ModelShape, cost_split

# Bytes per logit at the loss, beyond the logits in compute dtype: the fp32 log-softmax the loss
# keeps (tessera's lm_loss upcasts) and the fp32 buffers of its backward -- two (the loss and
# log-softmax gradients), or three under loss parallelism (its fused backward's zeros, exp, product).
LOGIT_FP32_BUFFERS = (4 + 8, 4 + 12)


# While a block runs backward, the gradients of its activations (mostly of the FFN hidden) add about
# this fraction of the block's saved activations (measured with torch's MemTracker on tiny decoders).
BACKWARD_GRADIENTS = 0.35

# Muon's Newton-Schulz iteration on its largest matrix holds about this many copies of it (the iterate, the
# normalized input, the product terms), in the Newton-Schulz dtype.
NS_WORKING_COPIES = 4


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU at the peak moment, by kind."""

    params: float = 0.0
    grads: float = 0.0
    optim: float = 0.0
    activations: float = 0.0
    logits: float = 0.0
    inflight: float = 0.0  # activations of the extra pipeline micro-batches in flight
    buffers: float = 0.0  # FSDP gathered parameters and unsharded gradients, DDP buckets, autocast weight copies
    runtime: float = 0.0  # CUDA context, NCCL, allocator slack (GPU plans only)
    moment: str = ""
    pp_rank: int = 0

    @property
    def total(self) -> float:
        """All bytes."""
        return (
            self.params
            + self.grads
            + self.optim
            + self.activations
            + self.logits
            + self.inflight
            + self.buffers
            + self.runtime
        )


def zero_model_state_bytes(
    params: float, n: int, stage: int, param_bytes: int = 2, grad_bytes: int = 2, optim_bytes: int = 12
) -> float:
    """Model-state bytes per GPU under ZeRO ``stage`` on ``n`` ranks (Rajbhandari et al. 2020).

    The defaults are mixed-precision Adam: 16P (stage 0), 4P + 12P/N (1), 2P + 14P/N (2),
    16P/N (3). tessera's fp32-master variant is ``param_bytes=4, grad_bytes=4, optim_bytes=8``.
    """
    p = params
    return (
        param_bytes * p / (n if stage >= 3 else 1)
        + grad_bytes * p / (n if stage >= 2 else 1)
        + optim_bytes * p / (n if stage >= 1 else 1)
    )


@dataclass(frozen=True)
class RankShare:
    """The parameters one pp rank holds (before FSDP sharding), by stage."""

    stages: tuple[tuple[BlockParams, ...], ...]
    embedding: bool
    head: bool

    def local(self, shape: ModelShape, layout: Layout) -> float:
        """Parameter count on one (tp, ep) rank of this pp rank."""
        return sum(_block_local(b, layout) for s in self.stages for b in s) + self.root(shape, layout)

    def matrices(self, layout: Layout) -> float:
        """Parameters of the hidden matrices Muon updates on one (tp, ep) rank of this pp rank."""
        blocks = [b for s in self.stages for b in s]
        return sum(b.matrices[0] / layout.tp + b.matrices[1] + b.matrices[2] / layout.ep for b in blocks)

    def root(self, shape: ModelShape, layout: Layout) -> float:
        """Embedding and head parameters this rank holds (FSDP's root module)."""
        return (shape.embedding if self.embedding else 0) / layout.tp + (shape.head if self.head else 0) / layout.tp


def _block_local(block: BlockParams, layout: Layout) -> float:
    return block.tp / layout.tp + block.replicated + block.experts / layout.ep


def rank_share(
    shape: ModelShape, layout: Layout, pp_rank: int, layers_per_stage: str = "", seq_len: int = 0
) -> RankShare:
    """The stages (looped: rank, rank + pp, ...) and blocks pipeline rank ``pp_rank`` runs
    (``layers_per_stage="cost"`` balances the stages' FLOPs at ``seq_len``)."""
    n_stages = layout.pp * layout.virtual
    if layers_per_stage == COST_SPLIT:
        layers_per_stage = cost_split(shape, seq_len, n_stages)
    counts = stage_layer_counts(shape.n_layers, n_stages, layers_per_stage)
    starts = [sum(counts[:i]) for i in range(n_stages + 1)]
    ids = [pp_rank + k * layout.pp for k in range(layout.virtual)]
    stages = tuple(shape.blocks[starts[s] : starts[s + 1]] for s in ids)
    return RankShare(stages, 0 in ids, n_stages - 1 in ids)


def inflight_stages(layout: Layout, pp_rank: int) -> float:
    """Micro-batches whose activations a pp rank holds at its peak, in units of all its stages."""
    p, v, m = layout.pp, layout.virtual, layout.microbatches
    if p == 1:
        return 1.0
    if layout.schedule == "gpipe":
        return float(m)
    if v == 1:
        return float(min(m, p - pp_rank))
    per_round = m // max(1, m // p)
    factor = 1 if layout.schedule == "interleaved_zb" else 2
    warmup = min((v - 1) * per_round + factor * (p - 1 - pp_rank), m * v)
    return min(warmup + 1, m * v) / v


def _kept(mem: BlockMemory, layout: Layout, index: int) -> act.BlockActivation:
    if layout.ac == "full" or (layout.ac == "selective" and index % layout.ac_every == 0):
        return mem.checkpointed
    return mem.op if layout.ac == "op" else mem.full


@dataclass(frozen=True)
class StageActivations:
    """Activation bytes of one micro-batch on one pp rank."""

    kept: float  # saved for backward by all the rank's blocks (and its head): the loss moment
    last_backward: float  # activations while the last block runs backward (everything kept + its working set)
    inner_backward: float  # the most while an earlier block runs backward (its own and earlier blocks' + working set)


@lru_cache(maxsize=256)
def block_memory(shape: ModelShape, block: BlockParams, prec: Precision) -> BlockMemory:
    """:func:`tessera_block`, cached (a plan asks for the same few blocks thousands of times)."""
    return act.tessera_block(shape, block, prec)


def stage_activations(
    shape: ModelShape, share: RankShare, layout: Layout, prec: Precision, seq_len: int
) -> StageActivations:
    """What one micro-batch keeps on this rank, and the most it holds during a block's backward.

    During block i's backward, blocks 0..i still keep their activations and block i adds its
    working set: whatever checkpointing recomputes, plus the gradients of its activations.
    """
    tokens, keys = layout.micro_batch * seq_len // layout.cp, seq_len
    tp, sp = layout.tp, layout.sequence_parallel
    kept, during = 0.0, []
    for stage in share.stages:
        for i, block in enumerate(stage):
            mem = block_memory(shape, block, prec)
            full = mem.full.bytes(tokens, keys, tp, sp)
            kept_block = _kept(mem, layout, i).bytes(tokens, keys, tp, sp)
            kept += kept_block
            during.append(kept + (full - kept_block) + BACKWARD_GRADIENTS * full)
    boundary = (
        2 * tokens * prec.compute * shape.dim / (tp if sp else 1) if layout.pp > 1 else 0.0
    )  # received input, sent output
    head = 0.0
    if share.head:
        h = shape.dim
        head = tokens * ((4.0 * h + 4 + prec.stream * h) / (tp if sp else 1) + prec.compute * h)
    inner = max(during[:-1], default=0.0)
    return StageActivations(kept + head + boundary, (during[-1] if during else 0.0) + boundary, inner + boundary)


@dataclass(frozen=True)
class OptimizerState:
    """What the optimizer keeps and allocates: ``optim.name`` and the bytes per stored value (``optim.state_dtype``)."""

    name: str = "adamw"  # "adamw", or "muon" (Muon's momentum on hidden matrices, AdamW's moments on the rest)
    state_bytes: int = 4  # fp32 4, bf16 2
    ns_bytes: int = 2  # Muon's Newton-Schulz dtype (optim.muon.ns_dtype)
    kernel: str = "default"  # torch's AdamW kernel (optim.implementation): fused, foreach, for-loop, default

    @property
    def torch_adamw(self) -> bool:
        """torch.optim.AdamW (fp32 state) rather than tessera's MuonAdamW (Muon, or bf16 state)."""
        return self.name == "adamw" and self.state_bytes == 4


@dataclass(frozen=True)
class Setting:
    """What besides the layout decides memory: precisions, sequence length, where it runs, the loss, the optimizer."""

    prec: Precision
    seq_len: int
    device: str = "cuda"  # "cuda": AdamW's foreach temporaries, runtime overhead; "cpu": per-tensor AdamW
    layers_per_stage: str = ""
    loss_chunk: int = 0  # tokens per chunk of the fused head + loss (train.fused_loss); 0: the plain loss's logits
    optimizer: OptimizerState = OptimizerState()


@dataclass(frozen=True)
class Buffers:
    """Bytes of gathered/cast parameters and unsharded gradients at each moment of a step."""

    loss: float
    block_backward: float  # the last block's backward
    reducing: float  # added during an earlier block's backward: the later block's gradients being reduced
    backward_end: float


def _fsdp_buffers(shape: ModelShape, share: RankShare, layout: Layout, prec: Precision) -> Buffers:
    c, reduce = prec.compute, prec.reduce
    blocks = [_block_local(b, layout) for s in share.stages for b in s]
    root = share.root(shape, layout)
    if layout.pp > 1:  # torch.distributed.pipelining keeps params gathered and accumulates unsharded grads
        local = c * (sum(blocks) + root) + reduce * (sum(blocks) + root)
        return Buffers(local, local, 0.0, local)
    last = blocks[-1] if blocks else 0.0
    if not layout.reshard:  # everything stays gathered from forward to backward
        gathered = c * (sum(blocks) + root)
        return Buffers(gathered, gathered, (c + reduce) * last, c * root + (c + reduce) * root)
    # At the loss the root (embedding, head) is resharded again; the last block stays gathered for backward,
    # whose backward then also holds the prefetched next block.
    largest = max(blocks, default=0.0)
    return Buffers(c * last, c * (last + largest), (c + reduce) * largest, c * root + (c + reduce) * root)


def _buffers(shape: ModelShape, share: RankShare, layout: Layout, prec: Precision) -> Buffers:
    """FSDP's gathered parameters and unsharded gradients, DDP's buckets, autocast's weight copies."""
    if layout.fsdp:
        return _fsdp_buffers(shape, share, layout, prec)
    local = share.local(shape, layout)
    buckets = prec.grad * local if layout.dp_replicate > 1 else 0.0
    casts = prec.compute * (local - (shape.embedding / layout.tp if share.embedding else 0)) if prec.autocast else 0.0
    return Buffers(buckets + casts, buckets + casts, 0.0, buckets)


def rank_memory(shape: ModelShape, layout: Layout, setting: Setting, pp_rank: int) -> MemoryBreakdown:
    """The peak bytes of pipeline rank ``pp_rank``: the largest of the moments in the module docstring."""
    prec, share = setting.prec, rank_share(shape, layout, pp_rank, setting.layers_per_stage, setting.seq_len)
    local = share.local(shape, layout)
    n = layout.shard if layout.fsdp else 1
    states = {"params": prec.param * local / n, "optim": optimizer_state_bytes(shape, share, layout, setting) / n}
    states["pp_rank"] = pp_rank
    grads = prec.grad * local / n
    acts = stage_activations(shape, share, layout, prec, setting.seq_len)
    tokens = layout.micro_batch * setting.seq_len // layout.cp
    loss_logits, logits = _head_loss_bytes(shape, share, layout, setting, tokens)
    # tessera runs torch's schedules with return_outputs=False: a micro-batch's logits die with its backward
    outputs = 0.0
    inflight = acts.kept * (inflight_stages(layout, pp_rank) - 1)
    # Earlier micro-batches' sharded gradients; under a pipeline FSDP reduces only after the last micro-batch
    # (until then it accumulates unsharded gradients, counted in the buffers).
    earlier = grads if layout.microbatches > 1 and not (layout.pp > 1 and layout.fsdp) else 0.0
    buf = _buffers(shape, share, layout, prec)
    if setting.loss_chunk and layout.fsdp and layout.reshard and layout.pp == 1:
        # the fused loss runs inside the root module's forward: the embedding and head are still gathered,
        # and so is the block FSDP prefetches for backward
        root = share.root(shape, layout)
        largest = max((_block_local(b, layout) for s in share.stages for b in s), default=0.0)
        buf = dataclasses.replace(buf, loss=buf.loss + prec.compute * (root + largest))
    during = (
        ("loss", acts.kept, loss_logits, buf.loss),
        ("block backward", acts.last_backward, logits, buf.block_backward),
        ("block backward", acts.inner_backward, logits, buf.block_backward + buf.reducing),
    )
    moments = [
        MemoryBreakdown(grads=earlier, activations=a, logits=lg, inflight=inflight, buffers=bf, moment=m, **states)
        for m, a, lg, bf in during
    ]
    moments.append(
        MemoryBreakdown(grads=grads, inflight=outputs, buffers=buf.backward_end, moment="backward end", **states)
    )
    temp = _optimizer_temp(shape, share, layout, setting) + (0.0 if layout.fsdp else buf.backward_end)
    moments.append(MemoryBreakdown(grads=grads, inflight=outputs, buffers=temp, moment="optimizer step", **states))
    return max(moments, key=lambda m: m.total)


def _head_loss_bytes(
    shape: ModelShape, share: RankShare, layout: Layout, setting: Setting, tokens: int
) -> tuple[float, float]:
    """(bytes of the head's loss at the loss moment, bytes of it kept during the blocks' backward) on this rank.

    Plain loss: the (tokens x vocab) logits in compute dtype, plus at the loss their fp32 buffers. Fused
    loss (tessera/train/loss.py): the hidden-state gradient and the head's fp32 weight gradient it computes
    in forward, and one chunk's working set -- its fp32 logits, exponentiated in place (the loss), or its logits,
    their gradient in compute dtype and the chunk's (vocab x dim) weight-gradient product (the gradient).
    """
    if not share.head:
        return 0.0, 0.0
    c, rows = setting.prec.compute, shape.vocab / layout.tp
    if not setting.loss_chunk:
        logits = tokens * rows * c
        return logits / c * (c + LOGIT_FP32_BUFFERS[layout.tp > 1]), logits
    chunk, cast = min(setting.loss_chunk, tokens), (c if c != 4 else 0)
    working = max(4.0 * chunk * rows, (4.0 + cast) * chunk * rows + (c + (4 if cast else 0)) * rows * shape.dim)
    return tokens * shape.dim * setting.prec.stream + 4.0 * rows * shape.dim + working, 0.0


def optimizer_state_bytes(shape: ModelShape, share: RankShare, layout: Layout, setting: Setting) -> float:
    """Optimizer state of this pp rank's (tp, ep) share before FSDP sharding: AdamW's two moments per
    parameter; under Muon one momentum per hidden-matrix parameter; each in ``optim.state_dtype``."""
    opt = setting.optimizer
    muon = share.matrices(layout) if opt.name == "muon" else 0.0
    return opt.state_bytes * (2.0 * (share.local(shape, layout) - muon) + muon)


def _optimizer_temp(shape: ModelShape, share: RankShare, layout: Layout, setting: Setting) -> float:
    """The optimizer step's temporaries on this rank (after FSDP sharding)."""
    opt, n = setting.optimizer, (layout.shard if layout.fsdp else 1)
    foreach = opt.kernel == "foreach" or (opt.kernel == "default" and setting.device == "cuda")
    if opt.kernel == "fused" and opt.state_bytes == 4:  # torch's fused AdamW kernel: no full-size temporaries
        adamw = 0.0
    elif foreach and opt.torch_adamw:  # one fp32 list of every parameter
        adamw = 4.0 * share.local(shape, layout) / n
    else:  # per tensor: sqrt and its quotient; tessera's bf16 state also fp32 copies of both moments
        largest = _largest_tensor(shape, layout, matrices=opt.name != "muon")
        adamw = (8.0 if opt.state_bytes == 4 else 16.0) * largest / n
    if opt.name != "muon":
        return adamw
    # Muon: every matrix's update (fp32) is held until one orthogonalization of all of them returns each
    # result (Newton-Schulz dtype); the largest whole matrix's iteration adds its working copies.
    muon = share.matrices(layout) / n
    return max(adamw, (4.0 + opt.ns_bytes) * muon + NS_WORKING_COPIES * opt.ns_bytes * _largest_matrix(shape, layout))


def _largest_matrix(shape: ModelShape, layout: Layout) -> float:
    """The largest hidden matrix (or expert stack) of one ep rank, whole (before TP)."""
    return shape.dim * max(shape.ffn_hidden, shape.expert_hidden * (shape.experts // layout.ep if shape.experts else 0))


def _largest_tensor(shape: ModelShape, layout: Layout, matrices: bool = True) -> float:
    """The largest parameter tensor on one tp rank (of those AdamW updates: without Muon's ``matrices``)."""
    return max(shape.vocab * shape.dim, _largest_matrix(shape, layout) if matrices else 0.0) / layout.tp


def estimate_memory(
    shape: ModelShape, layout: Layout, setting: Setting, overhead: float = 0.0, slack: float = 0.0
) -> MemoryBreakdown:
    """Peak bytes per GPU over the pipeline ranks that can be largest (first and last), plus runtime costs."""
    ranks = {0, layout.pp - 1}
    peak = max((rank_memory(shape, layout, setting, r) for r in ranks), key=lambda m: m.total)
    if overhead or slack:
        from dataclasses import replace

        peak = replace(peak, runtime=overhead + slack * peak.total)
    return peak
