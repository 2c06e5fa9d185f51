"""Multi-head attention: MHA/MQA/GQA, self or cross, KV cache; the kernel of ``model.attention.kernel``
is looked up in the registry (one file per kernel in ``tessera/model/kernels/``).

``sdpa`` calls ``F.scaled_dot_product_attention`` (flash/memory-efficient on GPU); ``eager`` writes
softmax(QK^T * scale + bias)V out in float32 and hands the weights to ``weights_observer`` when an
inspection tool has set one (the linear kernels hand it their implicit weights); ``linear`` (elu + 1)
and ``performer`` (FAVOR+ random features) replace the softmax by a kernel feature map.

Windowed patterns (``sdpa`` with a sliding window, ``longformer``, ``bigbird``; see masks.py) run
block-sparse over whole sequences (:func:`block_sparse_attention`): each query block attends only
the key blocks its pattern reaches, gathered into one batched sdpa call, so memory and work grow as
O(length x window). Decoding with a sliding window keeps only the window in a ring buffer
(:class:`SlidingKVCache`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
from torch import nn

from tessera import registry
from tessera.config import ModelConfig, layer_heads
from tessera.dtypes import autocast_input
from tessera.model import kernels  # noqa: F401  (registers the kernels)
from tessera.model.kernels.common import AttnContext, SequenceSplit  # noqa: F401  (re-exported from their leaf)
from tessera.model.kernels.common import allowed_mask as _allowed  # noqa: F401  (re-exported)
from tessera.model.kernels.linear import PerformerFeatures, linear_attention  # noqa: F401  (re-exported)
from tessera.model.kernels.sdpa import block_sparse_attention  # noqa: F401  (re-exported)
from tessera.model.norm import RMSNorm, ZeroCenteredRMSNorm
from tessera.model.irope import l2_norm, layer_options, temperature
from tessera.model.position import apply_rope
from tessera.model.sinks import AttentionSinks


def kernel_spec(name: str) -> registry.KernelSpec:
    """The registered attention kernel ``name`` (``model.attention.kernel``)."""
    return registry.get("attention_kernel", name)


# The kernels without a score matrix (no masks, windows, biases): read from their specs.
LINEAR_KERNELS = tuple(s.name for s in registry.specs("attention_kernel") if not s.scores)


class KVCache:
    """Preallocated keys and values of one attention layer for incremental decoding."""

    def __init__(
        self, batch: int, n_kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def key_start(self, start: int) -> int:
        """Position of the first key :meth:`update` returns for queries from ``start``: all are kept."""
        return 0

    def update(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write positions ``start..start+T-1`` and return all keys/values up to there."""
        end = start + k.shape[2]
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        # A cache kept in a narrower dtype (--kv-cache bf16 for an fp32 model) is read back in the model's.
        return self.k[:, :, :end].to(k.dtype), self.v[:, :, :end].to(v.dtype)


class SlidingKVCache:
    """Keys and values of the last ``window`` positions only, in a ring buffer (slot = position % window).

    A query at position p sees keys p - window + 1 .. p, so older ones are never read again: memory
    stays O(window) however long the generation.
    """

    def __init__(
        self, batch: int, n_kv_heads: int, head_dim: int, window: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        shape = (batch, n_kv_heads, window, head_dim)
        self.window = window
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def key_start(self, start: int) -> int:
        """Position of the first key :meth:`update` returns for queries from ``start``."""
        return max(0, start - self.window)

    def update(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of positions ``key_start(start) .. start+T-1`` (the kept ones, then the new
        ``T``); then keep the last ``window`` of them."""
        kept = torch.arange(self.key_start(start), start, device=k.device) % self.window
        keys, values = torch.cat([self.k[:, :, kept], k], dim=2), torch.cat([self.v[:, :, kept], v], dim=2)
        new = min(k.shape[2], self.window)
        slots = torch.arange(start + k.shape[2] - new, start + k.shape[2], device=k.device) % self.window
        self.k[:, :, slots] = k[:, :, -new:]
        self.v[:, :, slots] = v[:, :, -new:]
        return keys, values


class Attention(nn.Module):
    """Self- or cross-attention; ``n_kv_heads`` < ``n_heads`` gives GQA (1 gives MQA)."""

    def __init__(self, cfg: ModelConfig, cross: bool = False) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads or cfg.n_heads
        self.head_dim = cfg.head_dim or cfg.dim // cfg.n_heads
        self.scale = cfg.attention.scale or 1.0 / math.sqrt(self.head_dim)
        self.kernel, self.cross, self.attn_dropout = cfg.attention.kernel, cross, cfg.attention.dropout
        self.softcap = cfg.attention.softcap  # > 0: the eager kernel caps the scores (tessera.model.softcap)
        # Gated attention (Qwen3-Next): q_proj also yields a gate per head, laid out [q_h, gate_h] head by head.
        self.output_gate = cfg.attention.output_gate and not cross
        q_width = self.n_heads * self.head_dim * (2 if self.output_gate else 1)
        self.q_proj = nn.Linear(cfg.dim, q_width, bias=cfg.attention.qkv_bias)
        self.k_proj = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=cfg.attention.qkv_bias)
        self.v_proj = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=cfg.attention.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.dim, bias=cfg.bias or cfg.attention.o_bias)
        # Per head (Qwen3) or over all heads' channels of the projection (OLMoE: qk_norm_scope = "all").
        self.qk_norm_all = cfg.attention.qk_norm_scope == "all"
        q_width, k_width = (self.n_heads, self.n_kv_heads) if self.qk_norm_all else (1, 1)
        qk_norm = ZeroCenteredRMSNorm if cfg.norm == "zero_centered_rmsnorm" else RMSNorm
        self.q_norm = qk_norm(q_width * self.head_dim, cfg.norm_eps) if cfg.attention.qk_norm else None
        self.k_norm = qk_norm(k_width * self.head_dim, cfg.norm_eps) if cfg.attention.qk_norm else None
        state = kernel_spec(self.kernel).state
        self.features = state(cfg, self.head_dim) if state is not None else None
        # gpt-oss: a learned logit per head in every softmax's denominator (see tessera.model.sinks).
        self.sinks = AttentionSinks(self.n_heads) if cfg.attention.sinks else None
        # Llama 4, per layer (tessera.model.irope): the weightless QK L2 norm's eps (0: off) on RoPE layers and the
        # NoPE layers' temperature tuning (floor, scale); set by layer_options when the stack builds its layers.
        self.qk_l2_eps = 0.0
        self.temperature: tuple[int, float] | None = None
        # Set only while a tool inspects attention (eager kernel): called with each forward's weights.
        self.weights_observer: Callable[[torch.Tensor], None] | None = None
        # Set only while QK-clip (tessera/train/qk_clip.py) watches the logits: called with q, k and the context.
        self.qk_observer: Callable[[torch.Tensor, torch.Tensor, AttnContext], None] | None = None

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, heads * head_dim) -> (B, heads, T, head_dim); the head count follows the projection's
        width, so a tensor-parallel shard holding 1/tp of the heads needs no bookkeeping."""
        return x.view(x.shape[0], x.shape[1], -1, self.head_dim).transpose(1, 2)

    def forward(
        self,
        x: torch.Tensor,
        ctx: AttnContext,
        cache: KVCache | None = None,
        start: int = 0,
        memory: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend from ``x`` (B, T, dim) to itself (or to ``memory`` for cross-attention)."""
        b, t, _ = x.shape
        x = autocast_input(x)
        src = autocast_input(memory) if self.cross else x
        q, k = self.q_proj(x), self.k_proj(src)
        gate = None
        if self.output_gate:
            q, gate = q.view(b, t, -1, 2 * self.head_dim).chunk(2, dim=-1)
            q, gate = q.reshape(b, t, -1), gate.reshape(b, t, -1)
        if self.q_norm is not None and self.qk_norm_all:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = self._heads(q), self._heads(k), self._heads(self.v_proj(src))
        if self.q_norm is not None and not self.qk_norm_all:
            q, k = self.q_norm(q), self.k_norm(k)
        if ctx.cos is not None and not self.cross:
            q, k = apply_rope(q, ctx.cos, ctx.sin), apply_rope(k, ctx.cos, ctx.sin)
        if self.qk_l2_eps:
            q, k = l2_norm(q, self.qk_l2_eps), l2_norm(k, self.qk_l2_eps)
        if self.temperature is not None:
            q = (q * temperature(start, t, *self.temperature, q.device)).to(q.dtype)
        if self.qk_observer is not None:
            self.qk_observer(q, k, ctx)
        if cache is not None:
            k, v = cache.update(k, v, start)
        out = ctx.attend(self, q, k, v, ctx) if ctx.attend is not None else self.attend(q, k, v, ctx)
        out = out.transpose(1, 2).reshape(b, t, -1)
        return self.o_proj(out * torch.sigmoid(gate) if gate is not None else out)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        """The kernel: (B, H, Tq, D) queries over (B, H_kv, Tk, D) keys/values under ``ctx``'s mask.

        Looked up by name on every call: inspection tools switch a layer's ``kernel`` for one forward."""
        dropout = self.attn_dropout if self.training else 0.0
        return kernel_spec(self.kernel).attend(self, q, k, v, ctx, dropout)


def layer_attention_config(cfg: ModelConfig, layer_id: int) -> ModelConfig:
    """``cfg`` with layer ``layer_id``'s query and KV head counts (``model.attention.heads_per_layer``:
    whole GQA groups, so the group size and the head size stay the model's)."""
    if not cfg.attention.heads_per_layer:
        return cfg
    heads = layer_heads(cfg)[layer_id]
    kv = heads * (cfg.n_kv_heads or cfg.n_heads) // cfg.n_heads
    return dataclasses.replace(cfg, n_heads=heads, n_kv_heads=kv, head_dim=cfg.head_dim or cfg.dim // cfg.n_heads)


def scaled_by_layer(module: nn.Module, cfg: ModelConfig, layer_id: int) -> nn.Module:
    """``module`` with its score scale divided by ``layer_id + 1`` when ``model.attention.scale_by_layer``."""
    if cfg.attention.scale_by_layer:
        module.scale /= layer_id + 1
    return module


def kernel_flops(cfg: ModelConfig, seq_len: int) -> float:
    """An attention layer's score-product FLOPs per token: its kernel's term."""
    return kernel_spec(cfg.attention.kernel).terms.flops(cfg, seq_len)


def _build(cfg: ModelConfig, layer_id: int) -> Attention:
    return layer_options(
        scaled_by_layer(Attention(layer_attention_config(cfg, layer_id)), cfg, layer_id), cfg, layer_id
    )


def _forward(module: Attention, h: torch.Tensor, ctx: AttnContext, cache: KVCache | None, start: int) -> torch.Tensor:
    return module(h, ctx, cache, start)


def _new_cache(module: Attention, batch: int, max_len: int, dtype: torch.dtype, device: torch.device) -> KVCache:
    return KVCache(batch, module.n_kv_heads, module.head_dim, max_len, dtype, device)


MIXER = registry.register(
    registry.MixerSpec(
        name="attention",
        feature="attention layers (MHA, GQA, MQA)",
        keys=("model.n_heads", "model.n_kv_heads", "model.head_dim", "model.attention"),
        uses=lambda m: not m.mla.kv_rank and bool(set(m.layer_pattern or "A") & {"A", "G"}),
        unsupported={},
        checks=(),
        terms=registry.Terms(flops=kernel_flops, memory="kernel"),
        tp_plan=registry.ATTENTION_TP,
        letters={"A": "attention", "G": "global attention"},
        selects=lambda m: not m.mla.kv_rank,
        attr="attention",
        build=_build,
        forward=_forward,
        new_cache=_new_cache,
    )
)

QK_NORM_ALL = registry.option(
    name="qk_norm_all",
    feature="QK-norm over all heads",
    keys=("model.attention.qk_norm", "model.attention.qk_norm_scope"),
    uses=lambda m: m.attention.qk_norm and m.attention.qk_norm_scope == "all",
    unsupported={},  # under tp its statistics are reduced over the ranks (parallel/tensor_attention.py)
    checks=(),
)
