"""What the planner needs to know about a model: where its parameters live and its FLOPs per token.

Parameters are counted on a meta-device build of the real zoo model (so every component the zoo
has is counted exactly, for free), grouped by how the parallel layouts split them:

- ``tp``: the column/row-parallel projections of attention and the dense FFN (divided by tp);
- ``replicated``: norms, and under tessera's TP plan the whole MoE layer (router, shared
  experts) outside the experts, which runs replicated on every tp rank;
- ``experts``: the routed expert weights (divided by ep, not by tp);
- the token embedding (first pipeline stage) and the output head (last stage), both vocab-parallel.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from functools import lru_cache

import torch
from torch import nn

from tessera import registry
from tessera.config import ModelConfig
from tessera.layout import cost_balanced_counts
from tessera.model import build_model
from tessera.model.blocks import block_containers, muon_parameters
from tessera.model.ffn import GATED, ffn_hidden_size
from tessera.parallel.tensor import tp_sharded_modules
from tessera.train.flops import flops_per_token


@dataclass(frozen=True)
class BlockParams:
    """Parameter counts of one transformer block, by how layouts split them."""

    tp: int
    replicated: int
    experts: int
    moe: bool
    mixer: str = "attention"  # "attention", "latent" (MLA) or "mamba"
    ffn: bool = True  # a dense FFN or MoE sublayer follows the mixer
    layer: int = 0  # its index in one period of the model's block kinds
    matrices: tuple[int, int, int] = (0, 0, 0)  # of tp, replicated, experts: the matrices Muon updates (optim.name)

    @property
    def total(self) -> int:
        """All parameters of the block."""
        return self.tp + self.replicated + self.experts


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a model the planner reasons about (decoder, encoder or encoder-decoder)."""

    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_hidden: int  # dense FFN width (0 when every block is MoE)
    expert_hidden: int
    experts: int
    top_k: int
    gated: bool
    vocab: int
    blocks: tuple[BlockParams, ...]
    embedding: int  # token (+ type, learned position) embeddings: first stage
    head: int  # output projection (+ MLM head) and final norm: last stage; 0 extra when tied
    tied: bool
    cfg: ModelConfig = field(compare=False)

    @property
    def n_layers(self) -> int:
        """Transformer blocks (encoder + decoder for encoder-decoders)."""
        return len(self.blocks)

    @property
    def total(self) -> int:
        """All unique parameters."""
        return sum(b.total for b in self.blocks) + self.embedding + self.head

    @property
    def active_matmul(self) -> int:
        """Parameters one token multiplies with: all but the embedding lookup, top-k of the experts."""
        routed = sum(b.experts for b in self.blocks)
        active_experts = routed * self.top_k // self.experts if self.experts else 0
        return sum(b.tp + b.replicated for b in self.blocks) + active_experts + self.head_matmul

    @property
    def head_matmul(self) -> int:
        """Parameters of the head's matmuls (a tied head multiplies with the embedding table)."""
        return self.head + (self.vocab * self.dim if self.tied else 0)

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs per trained token, the count tessera's MFU uses (tessera/train/flop_count.py: active
        experts, causal attention over the keys each query sees, every mixer and head as it runs)."""
        return flops_per_token(self.cfg, seq_len)

    def block_flops(self, seq_len: int) -> list[float]:
        """Each block's share of :meth:`flops_per_token`: 6 per active matrix parameter (top-k of the routed
        experts), plus its mixer's registered term (an attention layer's: its kernel's score products)."""
        return [
            6.0 * (b.tp + b.replicated + (b.experts * self.top_k // self.experts if self.experts else 0))
            + registry.get("mixer", b.mixer).terms.flops(self.cfg, seq_len)
            for b in self.blocks
        ]


@lru_cache(maxsize=256)
def cost_split(shape: ModelShape, seq_len: int, n_stages: int) -> str:
    """``parallel.layers_per_stage="cost"`` resolved: the block counts (e.g. "5,3") that even out the
    stages' training FLOPs with the head and loss on the last stage (see :func:`cost_balanced_counts`)."""
    counts = cost_balanced_counts(shape.block_flops(seq_len), 6.0 * shape.head_matmul, n_stages)
    return ",".join(map(str, counts))


def _classify(block: nn.Module, layer: int) -> BlockParams:
    muon = {id(p) for p in muon_parameters(block)}
    sharded = tp_sharded_modules(block)  # parallel/tensor.py's TP plan
    counts = [0, 0, 0]  # tp, replicated, experts
    matrices = [0, 0, 0]
    for name, p in block.named_parameters():
        if ".experts." in f".{name}":
            kind = 2
        elif name.startswith("moe."):
            kind = 1
        else:
            kind = 0 if name.rpartition(".")[0] in sharded else 1
        counts[kind] += p.numel()
        matrices[kind] += p.numel() if id(p) in muon else 0
    tp, replicated, experts = counts
    moe = getattr(block, "moe", None) is not None
    ffn = moe or getattr(block, "feed_forward", None) is not None
    return BlockParams(tp, replicated, experts, moe, block.mixer, ffn, layer, (matrices[0], matrices[1], matrices[2]))


def one_period(cfg: ModelConfig) -> ModelConfig:
    """The same model with only one period of block kinds (``layer_pattern``, every ``moe.every``-th MoE)."""
    period = math.lcm(max(1, cfg.moe.every) if cfg.moe.experts else 1, max(1, len(cfg.layer_pattern)))
    decoder = period if cfg.arch == "encoder_decoder" else 0
    return dataclasses.replace(cfg, n_layers=period, n_decoder_layers=decoder)


def model_shape(cfg: ModelConfig) -> ModelShape:
    """Count ``cfg``'s parameters on a meta build of one period of its blocks, then repeat it for all blocks."""
    small = one_period(cfg)
    with torch.device("meta"):
        model = build_model(small)
    stacks = [[_classify(b, i) for i, b in enumerate(layers.values())] for layers in block_containers(model)]
    in_blocks = {id(p) for layers in block_containers(model) for p in layers.parameters()}
    embedding = head = 0
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in in_blocks or id(p) in seen:
            continue
        seen.add(id(p))
        if name.startswith(("tok_embeddings", "type_embeddings")) or "pos_embeddings" in name or "rel_bias" in name:
            embedding += p.numel()
        else:
            head += p.numel()
    depths = [cfg.n_layers] + ([cfg.n_decoder_layers or cfg.n_layers] if cfg.arch == "encoder_decoder" else [])
    blocks = tuple(stack[i % len(stack)] for stack, depth in zip(stacks, depths) for i in range(depth))
    return _shape(cfg, blocks, embedding, head)


def _shape(cfg: ModelConfig, blocks: tuple[BlockParams, ...], embedding: int, head: int) -> ModelShape:
    dense = ffn_hidden_size(cfg.dim, cfg.activation, cfg.ffn_hidden, cfg.ffn_multiplier, cfg.multiple_of)
    experts = cfg.moe.experts
    expert_hidden = cfg.moe.ffn_hidden or dense
    shape = ModelShape(
        dim=cfg.dim,
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_kv_heads or cfg.n_heads,
        head_dim=cfg.head_dim or cfg.dim // cfg.n_heads,
        ffn_hidden=dense if any(not b.moe for b in blocks) else 0,
        expert_hidden=expert_hidden if experts else 0,
        experts=experts,
        top_k=cfg.moe.top_k if experts else 0,
        gated=cfg.activation in GATED,
        vocab=cfg.vocab_size,
        blocks=blocks,
        embedding=embedding,
        head=head,
        tied=cfg.tie_embeddings,
        cfg=cfg,
    )
    return shape


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n`` in increasing order."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
