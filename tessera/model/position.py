"""Position encodings. RoPE uses the rotate-half layout of HF Llama so weights map one-to-one."""

from __future__ import annotations

import torch
from torch import nn


def rope_tables(head_dim: int, max_len: int, theta: float, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (max_len, head_dim) in float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    t = torch.arange(max_len, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape (B, H, T, D) by tables already sliced to (T, D)."""
    dtype = x.dtype
    x = x.float()
    return (x * cos + _rotate_half(x) * sin).to(dtype)


class RotaryEmbedding(nn.Module):
    """Holds the RoPE tables (non-persistent buffers, rebuilt by ``reset_parameters``)."""

    def __init__(self, head_dim: int, max_len: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.max_len, self.theta = head_dim, max_len, theta
        cos, sin = rope_tables(head_dim, max_len, theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def reset_parameters(self) -> None:
        """Recompute the tables in place (needed after building on the meta device)."""
        cos, sin = rope_tables(self.head_dim, self.max_len, self.theta, device=self.cos.device)
        self.cos.copy_(cos)
        self.sin.copy_(sin)

    def forward(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for positions ``start .. start+length-1``."""
        if start + length > self.max_len:
            raise ValueError(f"position {start + length - 1} is beyond model.max_seq_len={self.max_len}")
        return self.cos[start : start + length], self.sin[start : start + length]
