"""The tessera model zoo: plain single-device PyTorch, no parallelism inside."""

from __future__ import annotations

from tessera.config import ModelConfig
from tessera.model.generate import generate, sample_next
from tessera.model.transformer import Decoder, count_parameters

__all__ = ["Decoder", "build_model", "count_parameters", "generate", "sample_next"]


def build_model(cfg: ModelConfig) -> Decoder:
    """The model the config names (the zoo adds encoder and encoder-decoder families)."""
    if cfg.arch == "decoder":
        return Decoder(cfg)
    raise ValueError(f"unknown model.arch {cfg.arch!r}")
