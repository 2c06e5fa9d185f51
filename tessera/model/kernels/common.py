"""What the attention kernels share: the context a forward hands every layer (:class:`AttnContext`),
what a kernel reads of its layer (:class:`AttentionLayer`), the context's boolean mask, KV heads
repeated for GQA, and the planner terms of the softmax kernels.

A leaf of ``tessera.model``'s attention: the kernels and ``model/attention.py`` import it, it imports
neither (``model/attention.py`` re-exports :class:`AttnContext` and :class:`SequenceSplit`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from tessera.model.masks import BlockLayout, MaskSpec
from tessera.registry import Terms

if TYPE_CHECKING:
    from tessera.model.moe import MoELog


class AttentionLayer(Protocol):
    """What an attention kernel reads of the layer it runs in (``tessera.model.attention.Attention``)."""

    kernel: str  # model.attention.kernel
    scale: float  # the score scale
    sinks: nn.Module | None  # gpt-oss's per-head sink logits (tessera.model.sinks.AttentionSinks)
    features: nn.Module | None  # the kernel's per-layer state (KernelSpec.state), e.g. Performer's features
    weights_observer: Callable[[torch.Tensor], None] | None  # set while a tool inspects the weights


# The attention core of a layer: (layer, q, k, v, context) -> output.
AttentionCore = Callable[[AttentionLayer, torch.Tensor, torch.Tensor, torch.Tensor, "AttnContext"], torch.Tensor]


@dataclass
class AttnContext:
    """What all layers of one forward share: the mask, a score bias and the RoPE tables."""

    mask: torch.Tensor | None = None  # bool (B|1, 1, Tq, Tk), True where attention is allowed
    blocks: BlockLayout | None = None  # a windowed pattern's block-sparse plan (instead of ``mask``)
    bias: torch.Tensor | None = None  # float (B|1, H, Tq, Tk) added to the scores (T5 bias, ALiBi)
    is_causal: bool = False  # plain causal over a square block: sdpa's fast path, no mask tensor
    causal: bool = False  # the linear kernels' only mask
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    document_ids: torch.Tensor | None = None  # (B, T): recurrent mixers restart at each new document
    # Set when this forward holds only part of each sequence: recurrent mixers scan it through this
    # (see tessera.model.recurrent.RecurrentSplit); the stack's SequenceSplit.
    split: Any = None
    moe_log: MoELog | None = None  # where MoE layers record their routing (see tessera.model.moe.MoELog)
    # Replaces every layer's attention core, (layer, q, k, v, this context) -> output: set when this forward
    # holds only part of each sequence and its queries must reach the other parts' keys (see SequenceSplit);
    # ``bias`` then spans the local queries and the keys of SequenceSplit.key_positions.
    attend: AttentionCore | None = None


class SequenceSplit(Protocol):
    """A forward that holds only some tokens of each sequence (context parallelism sets one on a
    :class:`~tessera.model.transformer.Stack` from outside; the zoo only calls it)."""

    def positions(self, length: int, device: torch.device) -> torch.Tensor:
        """(1, length) positions, in the whole sequence, of this forward's ``length`` tokens."""
        ...

    def key_positions(self, length: int, device: torch.device) -> torch.Tensor:
        """(1, keys) positions, in the whole sequence, of the keys the attention core scores, in its order
        (what a score bias such as ALiBi or T5's spans)."""
        ...

    def attention(
        self, spec: MaskSpec, length: int, document_ids: torch.Tensor | None, device: torch.device
    ) -> AttentionCore:
        """The attention core of one forward's layers (:attr:`AttnContext.attend`); it may exchange
        per-batch metadata (document ids) once here, for all layers."""
        ...

    def whole_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T_local, ...) -> (B, T, ...): every rank's tokens in sequence order (an encoder-decoder's
        cross-attention memory); the gradient of each rank's slice comes back to it."""
        ...


def allowed_mask(ctx: AttnContext, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor | None:
    """The context's boolean mask, materializing the implicit causal one when needed."""
    if ctx.mask is None and ctx.is_causal:
        return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - q_len)
    return ctx.mask


def repeat_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values with as many heads as the queries (GQA groups repeated)."""
    rep = q.shape[1] // k.shape[1]
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


def attention_flops(cfg: Any, seq_len: int) -> float:
    """Training FLOPs per token of one layer's score and value products over all ``seq_len`` keys (PaLM
    appendix B: 12 * H * Q * T, forward and backward; the planner's ModelShape.block_flops counts the same)."""
    return 12.0 * cfg.n_heads * (cfg.head_dim or cfg.dim // cfg.n_heads) * seq_len


def eager_memory(heads: int, q_width: int, kept: float) -> tuple[float, float]:
    """Saved bytes of a materialized softmax: fp32 scores and probabilities per key, fp32 copies of q and
    the repeated k, v; no logsumexp. Returns (kept bytes per token, score bytes per token per key)."""
    return kept + 12.0 * q_width - 4.0 * heads, 8.0 * heads


def flash_memory(cfg: Any, heads: int, q_width: int, kept: float) -> tuple[float, float]:
    """A fused kernel keeps its output and logsumexp only; with attention dropout sdpa runs the math path."""
    return eager_memory(heads, q_width, kept) if cfg.attention.dropout > 0 else (kept, 0.0)


SOFTMAX_TERMS = Terms(flops=attention_flops, memory=flash_memory)
