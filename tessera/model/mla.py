"""Multi-head latent attention (DeepSeek-V2/V3): keys and values rebuilt from a compressed latent.

Each token is projected to a latent of ``[model.mla].kv_rank`` channels (normalized) and one
``rope_head_dim`` key part that carries the position (RoPE) and is shared by all heads. Per-head
keys (an unrotated ``nope_head_dim`` part from the latent plus the shared rotated part) and values
are expanded from the latent by ``kv_b_proj``. Queries come from one projection or, with
``q_rank``, through a normalized low-rank bottleneck. The KV cache stores only the latent and the
rotated key: ``kv_rank + rope_head_dim`` numbers per token and layer, instead of
``2 * n_kv_heads * head_dim`` for standard attention.

Parameter names follow HF transformers' ``DeepseekV3Attention``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tessera import registry
from tessera.config import ModelConfig
from tessera.config.checks import require, require_all
from tessera.model.attention import AttnContext, _allowed, kernel_flops, scaled_by_layer
from tessera.model.norm import RMSNorm
from tessera.model.position import apply_rope


class LatentCache:
    """The compressed K/V latent (B, T, kv_rank) and rotated shared key (B, T, rope_head_dim) of one layer."""

    def __init__(self, batch: int, kv_rank: int, rope_dim: int, max_len: int, dtype: torch.dtype, device):
        self.latent = torch.zeros(batch, max_len, kv_rank, dtype=dtype, device=device)
        self.k_rope = torch.zeros(batch, max_len, rope_dim, dtype=dtype, device=device)

    def update(self, latent: torch.Tensor, k_rope: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write positions ``start..start+T-1`` and return everything up to there."""
        end = start + latent.shape[1]
        self.latent[:, start:end] = latent
        self.k_rope[:, start:end] = k_rope
        return self.latent[:, :end].to(latent.dtype), self.k_rope[:, :end].to(k_rope.dtype)  # as the model's dtype


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 without scaling)."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


class LatentAttention(nn.Module):
    """Causal self-attention through a low-rank K/V latent with a decoupled, shared RoPE key."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        mla = cfg.mla
        self.n_heads, self.kv_rank = cfg.n_heads, mla.kv_rank
        self.nope, self.rope, self.v_dim = mla.nope_head_dim, mla.rope_head_dim, mla.v_head_dim
        qk_dim = self.nope + self.rope
        self.scale = cfg.attention.scale or qk_dim**-0.5
        if mla.mscale and cfg.position.rope_scaling != "none":  # DeepSeek's yarn_apply_mscale
            self.scale *= yarn_mscale(cfg.position.rope_scaling_factor, mla.mscale) ** 2
        bias = cfg.attention.qkv_bias
        if mla.q_rank:
            self.q_a_proj = nn.Linear(cfg.dim, mla.q_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_rank, mla.norm_eps or cfg.norm_eps)
            self.q_b_proj = nn.Linear(mla.q_rank, self.n_heads * qk_dim, bias=False)
            self.q_proj = None
        else:
            self.q_proj = nn.Linear(cfg.dim, self.n_heads * qk_dim, bias=False)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        self.kv_a_proj_with_mqa = nn.Linear(cfg.dim, self.kv_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, mla.norm_eps or cfg.norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_rank, self.n_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.v_dim, cfg.dim, bias=cfg.bias or cfg.attention.o_bias)
        self.dropout = cfg.attention.dropout
        # Set only while a tool inspects attention: called with each forward's softmax weights (float32).
        self.weights_observer: Callable[[torch.Tensor], None] | None = None

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(x) if self.q_proj is not None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(x.shape[0], x.shape[1], -1, self.nope + self.rope).transpose(1, 2)

    def forward(
        self, x: torch.Tensor, ctx: AttnContext, cache: LatentCache | None = None, start: int = 0
    ) -> torch.Tensor:
        """Attend from ``x`` (B, T, dim) to itself (and to the cached positions before ``start``)."""
        b, t, _ = x.shape
        q_nope, q_rope = self._queries(x).split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)
        if ctx.cos is not None:  # position.kind = "none": NoPE latent attention (Kimi Linear), nothing rotates
            q_rope = apply_rope(q_rope, ctx.cos, ctx.sin)
            k_rope = apply_rope(k_rope[:, None], ctx.cos, ctx.sin)[:, 0]  # one rotated key for all heads
        if cache is not None:
            latent, k_rope = cache.update(latent, k_rope, start)
        kv = self.kv_b_proj(latent).view(b, latent.shape[1], -1, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope[:, None].expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        # A sequence split (context parallelism) brings its own core over the other ranks' keys.
        out = ctx.attend(self, q, k, v, ctx) if ctx.attend is not None else self.attend(q, k, v, ctx)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        """The core: (B, H, Tq, nope + rope) queries over (B, H, Tk, .) keys and (B, H, Tk, v_head_dim) values."""
        if self.weights_observer is not None:
            scores = (q.float() @ k.float().transpose(-2, -1)) * self.scale
            allowed = _allowed(ctx, q.shape[2], k.shape[2], q.device)
            scores = scores if allowed is None else scores.masked_fill(~allowed, float("-inf"))
            self.weights_observer(scores.softmax(dim=-1))
        dropout = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=ctx.mask, dropout_p=dropout, is_causal=ctx.is_causal, scale=self.scale
        )

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device) -> LatentCache:
        """An empty latent cache for ``max_len`` positions."""
        return LatentCache(batch, self.kv_rank, self.rope, max_len, dtype, device)


def check_mla(m: ModelConfig) -> None:
    """[model.mla]: its widths, and RoPE with a dense softmax kernel (the decoupled rotary key part)."""
    mla = m.mla
    require_all("model.mla", mla, ("rope_head_dim", "v_head_dim"), positive=True)
    require_all("model.mla", mla, ("q_rank", "nope_head_dim", "mscale", "norm_eps"), positive=False)
    require(
        m.position.kind in ("rope", "none") and m.attention.kernel in ("sdpa", "eager"),
        "model.mla needs model.position.kind 'rope' (or 'none': no positions, Kimi Linear) and model.attention.kernel "
        "sdpa or eager",
    )


def _forward(module: LatentAttention, h: torch.Tensor, ctx: AttnContext, cache: LatentCache | None, start: int):
    return module(h, ctx, cache, start)


def _new_cache(module: LatentAttention, batch: int, max_len: int, dtype: torch.dtype, device: torch.device):
    return module.new_cache(batch, max_len, dtype, device)


MIXER = registry.register(
    registry.MixerSpec(
        name="latent",
        feature="latent attention",
        keys=("model.mla",),
        uses=lambda m: bool(m.mla.kv_rank),
        unsupported={},
        # heads split after the low-rank projections (parallel/tensor_attention.py)
        tp_plan={"q_b_proj": "colwise", "q_proj": "colwise", "kv_b_proj": "colwise", "o_proj": "rowwise"},
        checks=(check_mla,),
        terms=registry.Terms(flops=kernel_flops, memory=registry.TRACED),
        letters={"A": "attention", "G": "global attention"},
        selects=lambda m: bool(m.mla.kv_rank) and not m.dsa.topk,  # with [model.dsa]: the sparse mixer (dsa.py)
        attr="attention",
        build=lambda cfg, layer_id: scaled_by_layer(LatentAttention(cfg), cfg, layer_id),
        forward=_forward,
        new_cache=_new_cache,
    )
)
