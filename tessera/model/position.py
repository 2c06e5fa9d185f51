"""Position encodings: RoPE (+ linear / NTK / YaRN scaling, partial rotary), learned, sinusoidal,
T5 relative-position bias and ALiBi. RoPE uses HF Llama's rotate-half layout so weights map 1:1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tessera import registry
from tessera.config import PositionConfig
from tessera.config.checks import require


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE frequencies are stretched for a longer context (see [model.position])."""

    kind: str = "none"  # none | linear | ntk | yarn | llama3
    factor: float = 1.0
    original_max_len: int = 0  # yarn, llama3: the pre-extension context
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    attention_factor: float = 0.0  # yarn: cos/sin magnitude (0 = 0.1 * ln(factor) + 1)
    truncate: bool = True  # yarn: the blend's dimension range rounded outward to integers (HF ``truncate``)


def rope_scaling_of(pos: PositionConfig, max_len: int) -> RopeScaling:
    """The RoPE scaling a ``[model.position]`` section describes (original length resolved)."""
    factor = pos.rope_scaling_factor
    return RopeScaling(
        pos.rope_scaling,
        factor,
        pos.rope_original_max_len or int(max_len / factor),
        pos.rope_low_freq_factor,
        pos.rope_high_freq_factor,
        pos.rope_attention_factor,
        pos.rope_yarn_truncate,
    )


def rope_inv_freq(rot_dim: int, theta: float, scaling: RopeScaling = RopeScaling()) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (rot_dim / 2,) and the cos/sin magnitude (YaRN's attention factor, else 1)."""
    exponents = torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim
    factor = scaling.factor
    if scaling.kind == "ntk":
        theta = theta * factor ** (rot_dim / (rot_dim - 2))
    inv_freq = 1.0 / (theta**exponents)
    if scaling.kind == "linear":
        return inv_freq / factor, 1.0
    if scaling.kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if scaling.kind != "yarn" or factor <= 1.0:
        return inv_freq, 1.0

    # YaRN (Peng et al. 2023): interpolate the slow dimensions, keep the fast ones, blend in between.
    def correction_dim(rotations: float) -> float:
        return rot_dim * math.log(scaling.original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(32.0), correction_dim(1.0)
    if scaling.truncate:  # HF's default; gpt-oss keeps the fractional range (truncate=false)
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rot_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1 where the original (extrapolated) frequency is kept
    inv_freq = (inv_freq / factor) * (1 - keep) + inv_freq * keep
    return inv_freq, scaling.attention_factor or 0.1 * math.log(factor) + 1.0


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by the factor, short ones kept, a smooth blend in between."""
    wavelen = 2 * math.pi / inv_freq
    long_wave, short_wave = s.original_max_len / s.low_freq_factor, s.original_max_len / s.high_freq_factor
    # Equal factors (Llama 4 Scout: 1 and 1) leave no blended band: any finite divisor serves.
    band = (s.high_freq_factor - s.low_freq_factor) or 1.0
    smooth = (s.original_max_len / wavelen - s.low_freq_factor) / band
    blended = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    out = torch.where(wavelen > long_wave, inv_freq / s.factor, inv_freq)
    return torch.where((wavelen >= short_wave) & (wavelen <= long_wave), blended, out)


class RotaryEmbedding(nn.Module):
    """RoPE cos/sin tables (non-persistent buffers, rebuilt by ``reset_parameters``); ``sin`` is kept signed
    (:func:`signed_sin`), the form :func:`apply_rope` takes."""

    def __init__(
        self, head_dim: int, max_len: int, theta: float, scaling: RopeScaling = RopeScaling(), fraction: float = 1.0
    ) -> None:
        super().__init__()
        self.rot_dim = int(head_dim * fraction)
        self.max_len, self.theta, self.scaling = max_len, theta, scaling
        cos, sin = self._tables()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq, magnitude = rope_inv_freq(self.rot_dim, self.theta, self.scaling)
        t = torch.arange(self.max_len, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq.to(device))
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * magnitude, signed_sin(emb.sin() * magnitude)

    def reset_parameters(self) -> None:
        """Recompute the tables in place (needed after building on the meta device)."""
        cos, sin = self._tables(device=self.cos.device)
        self.cos.copy_(cos)
        self.sin.copy_(sin)

    def forward(
        self, start: int, length: int, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of shape (1 or B, 1, T, rot_dim) for ``positions`` (B, T) or ``start .. start+length-1``."""
        if positions is None:
            if start + length > self.max_len:
                raise ValueError(f"position {start + length - 1} is beyond model.max_seq_len={self.max_len}")
            return self.cos[None, None, start : start + length], self.sin[None, None, start : start + length]
        check_positions(positions, self.max_len)
        return self.cos[positions][:, None], self.sin[positions][:, None]


def check_positions(positions: torch.Tensor, max_len: int) -> None:
    """Raise a clear error when a position is past the table (``model.max_seq_len``).

    Checked on the CPU only: on an accelerator reading the maximum would stall the host every
    forward, and the table lookup that follows fails there anyway (a device-side index assert).
    """
    if positions.device.type != "cpu":
        return
    if positions.numel() and int(positions.max()) >= max_len:
        raise ValueError(
            f"position {int(positions.max())} is beyond model.max_seq_len={max_len}; raise model.max_seq_len"
        )


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """The sin table with its first half negated, ``[-s1, s2]``: the sign of HF's ``rotate_half`` moved into the
    table, once, so that :func:`apply_rope` needs no negation and no concatenation per call."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the leading ``cos.shape[-1]`` channels of ``x`` (B, H, T, D); the rest pass through.

    ``sin`` is the signed table (:func:`signed_sin`, as :class:`RotaryEmbedding` holds it). Rolling the rotated
    channels by half gives ``[x2, x1]``, and ``[x2, x1] * [-s1, s2]`` is HF's ``rotate_half(x) * sin`` to the bit
    (values and gradients), in one kernel instead of a chunk, a negation and a concatenation.
    """
    dtype, rot = x.dtype, cos.shape[-1]
    x = x.float()
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    out = x_rot * cos + torch.roll(x_rot, rot // 2, dims=-1) * sin
    return torch.cat((out, x_pass), dim=-1).to(dtype) if x_pass.shape[-1] else out.to(dtype)


def sinusoidal_table(max_len: int, dim: int, device: torch.device | None = None) -> torch.Tensor:
    """Vaswani et al. table (max_len, dim): sin on even channels, cos on odd ones."""
    pos = torch.arange(max_len, dtype=torch.float32, device=device)[:, None]
    div = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32, device=device) * (-math.log(10000.0) / dim))
    table = torch.zeros(max_len, dim, device=device)
    table[:, 0::2] = torch.sin(pos * div)
    table[:, 1::2] = torch.cos(pos * div)[:, : dim // 2]
    return table


class AbsolutePositions(nn.Module):
    """Learned (an embedding table, ``weight``) or fixed sinusoidal absolute positions."""

    def __init__(self, kind: str, max_len: int, dim: int) -> None:
        super().__init__()
        self.kind, self.max_len, self.dim = kind, max_len, dim
        if kind == "learned":
            self.weight = nn.Parameter(torch.empty(max_len, dim))
        else:
            self.register_buffer("weight", sinusoidal_table(max_len, dim), persistent=False)

    def reset_parameters(self, std: float = 0.02) -> None:
        """Learned: normal(0, std); sinusoidal: recompute the table."""
        with torch.no_grad():
            if self.kind == "learned":
                nn.init.normal_(self.weight, std=std)
            else:
                self.weight.copy_(sinusoidal_table(self.max_len, self.dim, self.weight.device))

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """Embeddings of ``positions`` (any shape of ints)."""
        check_positions(positions, self.max_len)
        return self.weight[positions]


def t5_bucket(relative: torch.Tensor, bidirectional: bool, n_buckets: int, max_distance: int) -> torch.Tensor:
    """T5's bucket of each relative position (key - query): exact for small, log-spaced for large."""
    buckets = torch.zeros_like(relative)
    if bidirectional:
        n_buckets //= 2
        buckets = buckets + (relative > 0).long() * n_buckets
        distance = relative.abs()
    else:
        distance = (-relative).clamp(min=0)
    exact = n_buckets // 2
    log_ratio = torch.log(distance.float().clamp(min=1) / exact) / math.log(max_distance / exact)
    large = (exact + (log_ratio * (n_buckets - exact)).long()).clamp(max=n_buckets - 1)
    return buckets + torch.where(distance < exact, distance, large)


class RelativePositionBias(nn.Module):
    """T5 bucketed relative-position bias, one learned scalar per (bucket, head)."""

    def __init__(self, n_heads: int, n_buckets: int, max_distance: int, bidirectional: bool) -> None:
        super().__init__()
        self.n_buckets, self.max_distance, self.bidirectional = n_buckets, max_distance, bidirectional
        self.relative_attention_bias = nn.Embedding(n_buckets, n_heads)

    def forward(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Bias (B or 1, H, Tq, Tk) from query positions (B or 1, Tq) and key positions (B or 1, Tk)."""
        relative = k_pos[:, None, :] - q_pos[:, :, None]
        bucket = t5_bucket(relative, self.bidirectional, self.n_buckets, self.max_distance)
        return self.relative_attention_bias(bucket).permute(0, 3, 1, 2)


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """ALiBi head slopes (Press et al.): a geometric series, interleaved for non-powers of two."""
    closest = 2 ** math.floor(math.log2(n_heads))
    base = 2.0 ** (-8.0 / closest)
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest < n_heads:
        extra = 2.0 ** (-4.0 / closest)
        slopes += [extra ** (2 * i + 1) for i in range(n_heads - closest)]
    return torch.tensor(slopes, dtype=torch.float32)


class AlibiBias(nn.Module):
    """ALiBi as a module: the head slopes (a buffer derived from the head count) and the bias."""

    def __init__(self, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.register_buffer("slopes", alibi_slopes(n_heads), persistent=False)

    def reset_parameters(self) -> None:
        """Recompute the slopes (after a meta-device build)."""
        with torch.no_grad():
            self.slopes.copy_(alibi_slopes(self.n_heads))

    def forward(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Bias (B or 1, H, Tq, Tk); see :func:`alibi_bias`."""
        return alibi_bias(self.slopes, q_pos, k_pos)


def alibi_bias(slopes: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """Bias (B or 1, H, Tq, Tk) = -slope * |query - key| (linear in distance)."""
    distance = (q_pos[:, :, None] - k_pos[:, None, :]).abs().float()
    return -slopes.to(distance.device)[None, :, None, None] * distance[:, None]


def check_rope(m: Any) -> None:
    """RoPE rotates pairs of channels: the rotary width (head size x rotary_fraction) must be even."""
    head_dim = m.mla.rope_head_dim if m.mla.kv_rank else m.head_dim or m.dim // m.n_heads
    rot = int(head_dim * m.position.rotary_fraction)
    require(
        rot > 0 and rot % 2 == 0,
        "model.position.kind='rope' needs an even rotary width, got "
        f"head_dim*rotary_fraction={head_dim * m.position.rotary_fraction:g}; change model.position.rotary_fraction "
        "or model.head_dim",
    )


def check_alibi(m: Any) -> None:
    """ALiBi's slopes are defined for self-attention of one stack."""
    require(m.arch != "encoder_decoder", "model.position.kind='alibi' is not supported for arch='encoder_decoder'")


NO_TERMS = registry.Terms(flops=registry.zero, memory=registry.zero)  # positions add no planned FLOPs or bytes


def _position(kinds: tuple[str, ...], feature: str, checks: tuple = (), keys: tuple[str, ...] = ()) -> list:
    return [
        registry.register(
            registry.Spec(
                kind="position",
                name=kind,
                feature=feature,
                keys=("model.position.kind", *keys),
                uses=lambda m, kind=kind: m.position.kind == kind,
                unsupported={},
                checks=checks,
                terms=NO_TERMS,
            )
        )
        for kind in kinds
    ]


POSITIONS = [
    *_position(("rope",), "RoPE (+ linear, NTK, YaRN, llama3 scaling)", (check_rope,), ("model.position.rope_theta",)),
    *_position(("learned", "sinusoidal"), "absolute positions (learned, sinusoidal)"),
    *_position(("t5_bias",), "T5 relative-position bias", keys=("model.position.rel_buckets",)),
    *_position(("alibi",), "ALiBi", (check_alibi,)),
    *_position(("none",), "no positions"),
]
