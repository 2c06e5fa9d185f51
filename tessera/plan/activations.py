"""Activation memory of one transformer block: the bytes autograd keeps for backward, per token.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
Table 2) count a GPT block's saved activations in units of ``sbh`` bytes (``s`` sequence,
``b`` micro-batch, ``h`` hidden, ``a`` heads, ``t`` tensor-parallel degree, 2-byte values):

    no parallelism          sbh (34 + 5as/h)
    tensor parallel         sbh (10 + 24/t + 5as/(ht))
    TP + sequence parallel  sbh/t (34 + 5as/h)
    TP + SP + selective     34 sbh/t
    full recomputation      2 sbh

The same accounting, split by where each saved tensor lives, describes tessera's blocks: a
:class:`BlockActivation` holds bytes per token in four groups --

- ``residual``: norm inputs/outputs and dropout masks (sequence-sharded under SP, else whole);
- ``gathered``: the inputs of the column-parallel projections (whole without SP; under SP
  Megatron keeps them sharded and re-gathers in backward, while DTensor saves the gathered copy,
  so in tessera they stay whole);
- ``sharded``: everything inside the tensor-parallel region (heads, FFN hidden): divided by t;
- ``scores``: bytes per token per key position (softmax probabilities kept by non-fused
  attention), divided by t -- zero for SDPA/flash kernels, which is Korthikanti's "selective".

:func:`korthikanti_block` gives the paper's GPT block in these terms (6h + 4h + 24h + 5a·s, in
bytes), and :func:`tessera_block` the zoo's blocks as tessera runs them (RMSNorm computed in
fp32, SwiGLU, GQA, SDPA, autocast copies or FSDP's bf16 parameters), term by term; both are
checked by tests, the latter against the bytes autograd actually saves.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tessera import registry
from tessera.model import components  # noqa: F401  (registers the zoo's specs)
from tessera.plan.shapes import BlockParams, ModelShape


@dataclass(frozen=True)
class Precision:
    """Bytes per value of each kind of tensor, as a layout's precision settings produce them."""

    param: int  # resident parameters (tessera keeps fp32 parameters as the master copy)
    grad: int  # resident gradients
    optim: int  # optimizer state per parameter (AdamW: two fp32 moments)
    compute: int  # matmul inputs/outputs and gathered parameters
    stream: int  # the residual stream between blocks
    autocast: bool  # per-op casts (q/k/v, and gate/up, share one cast copy of their input)
    reduce: int  # gradient reduction dtype (FSDP reduce_dtype)


def tessera_precision(dtype: str, fsdp: bool) -> Precision:
    """What tessera does for ``train.dtype``: fp32 throughout; bf16/fp16 via FSDP's
    mixed-precision policy (bf16 parameters and stream) or, without FSDP, via autocast."""
    if dtype == "fp32":
        return Precision(4, 4, 8, 4, 4, False, 4)
    if fsdp:
        return Precision(4, 4, 8, 2, 2, False, 4)
    return Precision(4, 4, 8, 2, 4, True, 4)


@dataclass(frozen=True)
class BlockActivation:
    """Bytes one block keeps for backward per token, by how TP/SP split them (see module doc)."""

    residual: float
    gathered: float
    sharded: float
    scores: float = 0.0  # per token per key position

    def bytes(self, tokens: int, keys: int, tp: int = 1, sp: bool = False, megatron_sp: bool = False) -> float:
        """Saved bytes of ``tokens`` tokens attending to ``keys`` positions at tensor-parallel degree ``tp``."""
        residual = self.residual / tp if sp else self.residual
        gathered = self.gathered / tp if sp and megatron_sp else self.gathered
        return tokens * (residual + gathered + (self.sharded + self.scores * keys) / tp)


@dataclass(frozen=True)
class BlockMemory:
    """What one block keeps under each activation-checkpointing mode."""

    full: BlockActivation  # no checkpointing
    checkpointed: BlockActivation  # a checkpointed block keeps only its input
    op: BlockActivation  # op-level selective: matmul and attention outputs plus the input


def korthikanti_block(h: int, a: int) -> BlockMemory:
    """Korthikanti et al.'s GPT block (fp16, LayerNorm, GeLU 4h, dropout, unfused softmax)."""
    # residual: 2 LayerNorm inputs (2h each) + 2 dropout masks (h each); gathered: QKV and FC1 inputs;
    # sharded: Q, K (4h), V (2h), projection input (2h), FC1 output (8h), GeLU output (8h);
    # scores: softmax output (2as), its dropout mask (as) and dropout output (2as) per token.
    full = BlockActivation(residual=6.0 * h, gathered=4.0 * h, sharded=24.0 * h, scores=5.0 * a)
    return BlockMemory(full, BlockActivation(2.0 * h, 0.0, 0.0), BlockActivation(2.0 * h, 4.0 * h, 24.0 * h))


def korthikanti_table2(s: int, b: int, h: int, a: int, t: int = 1, mode: str = "none") -> float:
    """Table 2 of Korthikanti et al. 2022, bytes per layer, written out as printed."""
    sbh = s * b * h
    return {
        "none": sbh * (34 + 5 * a * s / h),
        "tp": sbh * (10 + 24 / t + 5 * a * s / (h * t)),
        "tp_sp": sbh / t * (34 + 5 * a * s / h),
        "tp_sp_selective": 34 * sbh / t,
        "full": 2 * sbh,
    }[mode]


def _norm(h: int, prec: Precision, kind: str) -> float:
    # RMSNorm: fp32 input copy (or the fp32 stream itself), the rsqrt, and the normalized output;
    # LayerNorm: its input plus mean and rstd.
    return 4.0 * h + 4 + prec.stream * h if kind == "rmsnorm" else prec.stream * h + 8


def _ffn_part(shape: ModelShape, block: BlockParams, prec: Precision) -> tuple[float, float, float, float]:
    """(gathered, sharded, op gathered, op sharded) bytes per token of the FFN or MoE sublayer: the term its
    registered spec declares (model/ffn.py, model/moe.py)."""
    if not block.moe and not block.ffn:
        return 0.0, 0.0, 0.0, 0.0
    return registry.get("ffn", "moe" if block.moe else "dense").terms.memory(shape, block, prec)


def tessera_block(shape: ModelShape, block: BlockParams, prec: Precision) -> BlockMemory:
    """The saved bytes per token of one zoo block as tessera runs it (pre-/post-norm, SDPA or eager).

    The kernel's and the FFN's terms come from their registered specs; mixers whose spec says
    ``TRACED`` (Mamba, latent attention) are measured instead: see :func:`traced_mixer_bytes`.
    """
    if registry.get("mixer", block.mixer).terms.memory == registry.TRACED:
        return _traced_block(shape, block, prec)
    cfg = shape.cfg
    h, c, heads = shape.dim, prec.compute, shape.n_heads
    q, kv = heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
    residual = 2 * _norm(h, prec, cfg.norm) + (2 * h if cfg.dropout > 0 else 0.0)
    kept = c * (q + 2 * kv) + c * q + 4.0 * heads  # q, k, v after RoPE; a fused kernel's output and logsumexp
    # the kernel's own term (model/kernels/): what it keeps instead, and its score bytes per key
    attention, scores = registry.get("attention_kernel", cfg.attention.kernel).terms.memory(cfg, heads, q, kept)
    if cfg.attention.qk_norm:
        attention += (4 + c) * (q + kv)
    ffn_gathered, ffn_sharded, op_ffn_gathered, op_ffn_sharded = _ffn_part(shape, block, prec)
    gathered = c * h + ffn_gathered  # q/k/v input: one cast copy for the three (tessera.dtypes.autocast_input)
    full = BlockActivation(residual, gathered, attention + ffn_sharded, scores)
    # op-level checkpointing keeps the block input, q/k/v and o_proj outputs, the kernel outputs, FFN matmul
    # outputs (o_proj's and down_proj's whole-size, before the TP reduction)
    op = BlockActivation(
        prec.stream * h, c * h + op_ffn_gathered, c * (q + 2 * kv) + c * q + 4.0 * heads + op_ffn_sharded
    )
    return BlockMemory(full, BlockActivation(prec.stream * h, 0.0, 0.0), op)


def _traced_block(shape: ModelShape, block: BlockParams, prec: Precision) -> BlockMemory:
    """A Mamba or latent-attention block: its mixer measured, its FFN/MoE by formula (no TP: all whole)."""
    h = shape.dim
    mixer = traced_mixer_bytes(shape, block.layer, prec)
    ffn_gathered, ffn_sharded, op_gathered, op_sharded = _ffn_part(shape, block, prec)
    norm = _norm(h, prec, shape.cfg.norm) if block.ffn else 0.0
    full = BlockActivation(norm, mixer + ffn_gathered, ffn_sharded)
    op = BlockActivation(prec.stream * h, mixer + op_gathered, op_sharded)  # the mixer's own policy: kept whole
    return BlockMemory(full, BlockActivation(prec.stream * h, 0.0, 0.0), op)


_TRACED: dict[tuple[str, str, Precision], float] = {}


def traced_mixer_bytes(shape: ModelShape, layer: int, prec: Precision) -> float:
    """Bytes per token that a Mamba or latent-attention mixer (and its norm) keeps for backward.

    Their kernels (chunked scans, low-rank projections) keep tensors no short formula follows, so
    the real module runs once on fake tensors (shapes only, no storage) and the storages autograd
    saves are added up, at two chunks (Mamba) or 256 tokens; cached per model, mixer and precision (every layer of
    one mixer keeps the same bytes: a 28-block hybrid traces twice, not 28 times).
    """
    import json

    from tessera.model.mixers import mixer_for

    mixer = mixer_for(shape.cfg, layer).name
    key = (json.dumps(dataclasses.asdict(shape.cfg), sort_keys=True, default=str), mixer, prec)
    if key not in _TRACED:
        _TRACED[key] = _trace(shape, layer, prec)
    return _TRACED[key]


def _trace(shape: ModelShape, layer: int, prec: Precision) -> float:
    import contextlib

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tessera.model import build_model
    from tessera.plan.shapes import one_period

    cfg = shape.cfg
    mamba = cfg.layer_pattern and set(cfg.layer_pattern) & {"M", "m"}
    tokens = min(cfg.max_seq_len, 2 * cfg.mamba.chunk if mamba else 256)
    dtype = torch.bfloat16 if prec.compute == 2 and not prec.autocast else torch.float32
    with torch.device("meta"):
        model = build_model(one_period(cfg)).to(dtype)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        block = model.layers[str(layer)]
        spec = block.mixer_spec  # the layer's registered mixer, at block.<attr> with its norm at <attr>_norm
        norm, mixer = getattr(block, f"{spec.attr}_norm"), getattr(block, spec.attr)
        x = torch.randn(1, tokens, cfg.dim, dtype=dtype, requires_grad=True)
        ctx = model.context(1, tokens, 0, None, None, x.device)
        weights = {p.untyped_storage()._cdata for p in model.parameters()}
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()  # fake tensors have no data pointer; the storage object is the identity
            if storage._cdata not in weights:
                saved[storage._cdata] = storage.nbytes()
            return t

        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if prec.autocast else contextlib.nullcontext()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
            spec.forward(mixer, norm(x), ctx, None, 0)
    total = sum(saved.values())
    if prec.autocast:  # its weights' bf16 copies are counted with the other cast copies (buffers)
        total -= 2 * sum(p.numel() for p in mixer.parameters() if p.dim() >= 2)
    return max(0.0, total) / tokens
