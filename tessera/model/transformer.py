"""Decoder-only causal language model (Llama-style by default) built from the model config."""

from __future__ import annotations

import math

import torch
from torch import nn

from tessera.config import ModelConfig
from tessera.model.attention import KVCache
from tessera.model.block import TransformerBlock
from tessera.model.norm import build_norm
from tessera.model.position import RotaryEmbedding


class Decoder(nn.Module):
    """Token embedding, ``n_layers`` blocks, final norm, output head (optionally tied)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.rope = RotaryEmbedding(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta) if cfg.position == "rope" else None
        # A ModuleDict keyed by layer index keeps parameter names stable when stages drop layers.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.norm = build_norm(cfg.norm, cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.init_weights()

    def init_weights(self) -> None:
        """Normal(0, init_std) weights; residual-output projections scaled by 1/sqrt(2 n_layers)."""
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                is_out = name.endswith(("o_proj", "down_proj"))
                nn.init.normal_(module.weight, mean=0.0, std=out_std if is_out else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif hasattr(module, "reset_parameters"):
                module.reset_parameters()

    def forward(self, tokens: torch.Tensor, caches: list[KVCache] | None = None, start: int = 0) -> torch.Tensor:
        """Logits of shape (batch, seq, vocab); with ``caches``, positions start at ``start``."""
        h = self.tok_embeddings(tokens)
        for i, layer in enumerate(self.layers.values()):
            h = layer(h, self.rope, caches[i] if caches is not None else None, start)
        return self.output(self.norm(h))

    def new_caches(self, batch: int, max_len: int, dtype: torch.dtype | None = None) -> list[KVCache]:
        """One empty KV cache per layer, sized for ``max_len`` positions."""
        attn = next(iter(self.layers.values())).attention
        weight = self.output.weight
        return [
            KVCache(batch, attn.n_kv_heads, attn.head_dim, max_len, dtype or weight.dtype, weight.device)
            for _ in self.layers
        ]


def count_parameters(model: nn.Module, exclude_embeddings: bool = False) -> int:
    """Unique parameters (tied weights once); optionally without the token embedding table."""
    seen: set[int] = set()
    total = 0
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if exclude_embeddings and "tok_embeddings" in name:
            continue
        total += p.numel()
    return total
