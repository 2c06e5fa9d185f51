"""The tessera model zoo: plain single-device PyTorch, no parallelism inside."""

from __future__ import annotations

from torch import nn

from tessera.config import ModelConfig
from tessera.model.dsa import freeze_for_indexer_warmup
from tessera.model.generate import generate, generate_seq2seq, sample_next
from tessera.model.moe import MoELog, RouterStats, expert_load, moe_loss, moe_metrics
from tessera.model.transformer import Decoder, Encoder, EncoderDecoder, count_parameters

__all__ = [
    "Decoder",
    "Encoder",
    "EncoderDecoder",
    "build_model",
    "count_parameters",
    "expert_load",
    "generate",
    "generate_seq2seq",
    "MoELog",
    "RouterStats",
    "moe_loss",
    "moe_metrics",
    "sample_next",
]

ARCHS: dict[str, type[nn.Module]] = {"decoder": Decoder, "encoder": Encoder, "encoder_decoder": EncoderDecoder}


def build_model(cfg: ModelConfig) -> nn.Module:
    """The model ``model.arch`` names: Decoder, Encoder (masked LM) or EncoderDecoder (seq2seq)."""
    if cfg.arch not in ARCHS:
        raise ValueError(f"unknown model.arch {cfg.arch!r}; choose one of {', '.join(ARCHS)}")
    model = ARCHS[cfg.arch](cfg)
    if cfg.dsa.topk and cfg.dsa.stage == "warmup":  # DSA's warm-up trains the lightning indexers alone
        freeze_for_indexer_warmup(model)
    return model
