"""Normalization layers: RMSNorm (Llama), zero-centred RMSNorm (Qwen3-Next, Gemma) and LayerNorm (GPT-2, BERT)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and cast back (as Llama and HF do)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def reset_parameters(self) -> None:
        """Weights to one."""
        nn.init.ones_(self.weight)


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm with gain ``1 + weight`` and ``weight`` initialized to zero (Qwen3-Next, Gemma): weight decay
    pulls the gain towards one instead of zero. The product is taken in float32 before the cast back, as HF does."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)

    def reset_parameters(self) -> None:
        """Weights to zero (a unit gain)."""
        nn.init.zeros_(self.weight)


def build_norm(kind: str, dim: int, eps: float) -> nn.Module:
    """The norm named by ``model.norm``."""
    if kind == "rmsnorm":
        return RMSNorm(dim, eps)
    if kind == "zero_centered_rmsnorm":
        return ZeroCenteredRMSNorm(dim, eps)
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=eps)
    raise ValueError(f"unknown norm {kind!r}")
