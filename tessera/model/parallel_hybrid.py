"""The parallel hybrid mixer (Falcon-H1): attention and Mamba-2 side by side on the same normed input.

An ``H`` layer of ``model.layer_pattern`` computes, from the block's normed input ``h``::

    mamba = Mamba2(h * ssm_in) * ssm_out          # in_proj's output times the (z, x, B, C, dt) multipliers
    attn = Attention(h * attention_in) * attention_out   # keys times ``key`` (before RoPE)
    out = mamba + attn

and the block adds it to the residual stream, then runs its FFN (HF's ``FalconH1DecoderLayer``). The attention is
tessera's (the model's heads, ``[model.attention]``, RoPE); the Mamba-2 is tessera's scan and convolution
(:class:`~tessera.model.mamba.Mamba2Mixer`, ``[model.mamba]``) with an inner width of its own
(``[model.hybrid].mamba_inner``, HF's ``mamba_d_ssm``) and Falcon-H1's output gate: ``y * silu(z)`` alone, or a
gated RMSNorm before or after the gate (``gated_norm``, ``norm_before_gate``). The multipliers are forward-time
factors (muP: they shape the gradients too), never folded into the weights. Parameter names follow HF's
(``hybrid.attention.q_proj`` <-> ``self_attn.q_proj``, ``hybrid.mamba.in_proj`` <-> ``mamba.in_proj``).

Decoding keeps one :class:`HybridCache` per layer: the attention's keys and values and the Mamba state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera import registry
from tessera.config import ModelConfig
from tessera.config.checks import require
from tessera.model.attention import Attention, KVCache, kernel_flops, layer_attention_config
from tessera.model.mamba import GatedRMSNorm, Mamba2Mixer, check_mamba
from tessera.model.recurrent import RecurrentMixer


class ScaledLinear(nn.Linear):
    """``nn.Linear`` whose input is multiplied by ``scale_in`` and whose output by ``scale_out`` (a float, or one
    factor per run of output channels: ``sizes``). Parameter names stay ``weight``/``bias``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        scale_in: float = 1.0,
        scale_out: tuple[float, ...] = (1.0,),
        sizes: tuple[int, ...] = (),
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.scale_in, self.scale_out, self.sizes = scale_in, tuple(scale_out), tuple(sizes) or (out_features,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x * self.scale_in if self.scale_in != 1.0 else x)
        if all(s == 1.0 for s in self.scale_out):
            return y
        if len(self.scale_out) == 1:
            return y * self.scale_out[0]
        factors = torch.tensor(self.scale_out, dtype=y.dtype, device=y.device)
        return y * factors.repeat_interleave(torch.tensor(self.sizes, device=y.device), output_size=sum(self.sizes))


class SiluGate(nn.Module):
    """Falcon-H1's Mamba output without its norm (``mamba_rms_norm = false``): ``y * silu(z)``."""

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return (y.float() * F.silu(z.float())).to(y.dtype)


class NormThenGate(GatedRMSNorm):
    """The gated RMSNorm the other way round (HF's ``norm_before_gate = true``): ``norm(y) * silu(z)``."""

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = y.float()
        g = h.view(*h.shape[:-1], -1, self.group_size)
        g = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)).view(h.shape)
        return ((self.weight * g) * F.silu(z.float())).to(y.dtype)


def mamba_inner(cfg: ModelConfig) -> int:
    """The hybrid Mamba-2's inner width: ``[model.hybrid].mamba_inner``, or ``expand * dim``."""
    return cfg.hybrid.mamba_inner or cfg.mamba.expand * cfg.dim


class HybridMamba2(Mamba2Mixer):
    """Mamba-2 with Falcon-H1's inner width, input and projection multipliers and output gate; the scan, the
    convolution, the cache and the context-parallel split are :class:`Mamba2Mixer`'s."""

    def __init__(self, cfg: ModelConfig) -> None:
        RecurrentMixer.__init__(self)
        m, hy = cfg.mamba, cfg.hybrid
        self.inner, self.state, self.chunk, self.groups = mamba_inner(cfg), m.state, m.chunk, m.groups
        self.head_dim, self.dt_min = m.head_dim, m.dt_min
        self.heads = self.inner // m.head_dim
        self.conv_dim = self.inner + 2 * m.groups * m.state
        sizes = (self.inner, self.inner, m.groups * m.state, m.groups * m.state, self.heads)
        multipliers = (hy.ssm_z, hy.ssm_x, hy.ssm_b, hy.ssm_c, hy.ssm_dt)
        self.in_proj = ScaledLinear(cfg.dim, sum(sizes), m.proj_bias, hy.ssm_in, multipliers, sizes)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, m.conv, groups=self.conv_dim, padding=m.conv - 1, bias=m.conv_bias
        )
        self.dt_bias = nn.Parameter(torch.empty(self.heads))
        self.A_log = nn.Parameter(torch.empty(self.heads))
        self.D = nn.Parameter(torch.empty(self.heads))
        if not hy.gated_norm:
            self.norm: nn.Module = SiluGate()
        elif hy.norm_before_gate:
            self.norm = NormThenGate(self.inner, m.groups, cfg.norm_eps)
        else:
            self.norm = GatedRMSNorm(self.inner, m.groups, cfg.norm_eps)
        # HF's FalconH1Mixer: out_proj's bias follows projectors_bias, in_proj's mamba_proj_bias (one key here).
        self.out_proj = nn.Linear(self.inner, cfg.dim, bias=m.proj_bias)
        self.reset_parameters()


class HybridCache(KVCache):
    """One hybrid layer's decoding state: the attention's keys and values (:class:`KVCache`) and the Mamba-2
    convolution window and SSM state (``conv``, ``ssm``, read by the Mamba half as a MambaCache)."""

    def __init__(self, attention: Attention, mamba: HybridMamba2, batch: int, max_len: int, dtype, device) -> None:
        super().__init__(batch, attention.n_kv_heads, attention.head_dim, max_len, dtype, device)
        recurrent = mamba.new_cache(batch, device)
        self.conv, self.ssm = recurrent.conv, recurrent.ssm


class ParallelHybrid(nn.Module):
    """Attention and Mamba-2 on the same input, outputs scaled and summed (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, layer_id: int = 0) -> None:
        super().__init__()
        hy = cfg.hybrid
        self.attention = Attention(layer_attention_config(cfg, layer_id))
        k = self.attention.k_proj
        self.attention.k_proj = ScaledLinear(k.in_features, k.out_features, k.bias is not None, scale_out=(hy.key,))
        self.mamba = HybridMamba2(cfg)
        self.attention_in, self.attention_out, self.ssm_out = hy.attention_in, hy.attention_out, hy.ssm_out

    def forward(self, h: torch.Tensor, ctx, cache: HybridCache | None = None, start: int = 0) -> torch.Tensor:
        """The summed, scaled outputs of both mixers for the normed input ``h`` (B, T, dim)."""
        docs, split = getattr(ctx, "document_ids", None), getattr(ctx, "split", None)
        ssm = self.mamba(h, cache, start, docs, split) * self.ssm_out
        attn = self.attention(h * self.attention_in if self.attention_in != 1.0 else h, ctx, cache, start)
        return ssm + attn * self.attention_out


HYBRID_MULTIPLIERS = (
    "attention_in",
    "attention_out",
    "key",
    "ssm_in",
    "ssm_out",
    "ssm_z",
    "ssm_x",
    "ssm_b",
    "ssm_c",
    "ssm_dt",
)


def check_hybrid(m: ModelConfig) -> None:
    """[model.hybrid] with [model.mamba] version 2: the inner width splits into heads and groups; finite
    multipliers."""
    check_mamba(m)
    hy, mamba = m.hybrid, m.mamba
    require(
        mamba.version == 2,
        f"model.layer_pattern 'H' (parallel hybrid) runs Mamba-2; set model.mamba.version = 2 (got {mamba.version})",
    )
    require(hy.mamba_inner >= 0, f"model.hybrid.mamba_inner must be >= 0 (0 = expand * dim), got {hy.mamba_inner}")
    inner = mamba_inner(m)
    require(
        inner % mamba.head_dim == 0 and (inner // mamba.head_dim) % mamba.groups == 0,
        f"model.hybrid.mamba_inner={inner} must split into heads of model.mamba.head_dim={mamba.head_dim}, and the "
        f"heads into model.mamba.groups={mamba.groups}",
    )
    for key in HYBRID_MULTIPLIERS:
        value = getattr(hy, key)
        require(value == value and abs(value) != float("inf"), f"model.hybrid.{key} must be finite, got {value}")
    require(
        not m.mla.kv_rank and m.arch == "decoder",
        "model.layer_pattern 'H' (parallel hybrid) needs standard attention in a decoder (not model.mla)",
    )


def _flops(cfg: ModelConfig, seq_len: int) -> float:
    """The attention half's score products (the Mamba half's are in 6 * N, like Mamba layers')."""
    return kernel_flops(cfg, seq_len)


def _forward(module: ParallelHybrid, h: torch.Tensor, ctx, cache: HybridCache | None, start: int) -> torch.Tensor:
    return module(h, ctx, cache, start)


def _new_cache(module: ParallelHybrid, batch: int, max_len: int, dtype, device) -> HybridCache:
    return HybridCache(module.attention, module.mamba, batch, max_len, dtype, device)


# tp: tessera/parallel/tensor.py slices a Mamba mixer per rank only at a block's own ``mamba``, and this in_proj's
# per-segment multipliers assume the whole width. cp: each half takes its own split (the Mamba scan through
# ctx.split, the attention through ctx.attend); tests/integration/test_falcon_h1_parallel.py measures it.
HYBRID_UNSUPPORTED = {
    "tp": "the parallel hybrid's Mamba-2 half has no tensor-parallel slicing yet (parallel/recurrent.py slices a "
    "block's own 'mamba' only); run Falcon-H1-style 'H' layers with dp_shard/FSDP, cp or pp, without tp",
}

HYBRID = registry.register(
    registry.MixerSpec(
        name="parallel_hybrid",
        feature="parallel attention + Mamba-2 layers (Falcon-H1)",
        keys=("model.layer_pattern", "model.hybrid", "model.mamba", "model.attention"),
        uses=lambda m: "H" in m.layer_pattern,
        unsupported=HYBRID_UNSUPPORTED,
        checks=(check_hybrid,),
        terms=registry.Terms(flops=_flops, memory=registry.TRACED),
        tp_plan=None,
        letters={"H": "attention and Mamba-2 in parallel (Falcon-H1)"},
        attr="hybrid",
        recurrent=True,
        build=lambda cfg, layer_id: ParallelHybrid(cfg, layer_id),
        forward=_forward,
        new_cache=_new_cache,
    )
)
