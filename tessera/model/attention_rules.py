"""The rules of the 2026 attention options (sinks, windows) read against the rest of ``[model]``."""

from __future__ import annotations

from tessera.config import ModelConfig
from tessera.config.checks import require

# Kernels whose softmax can hold a sink logit (the linear kernels have no softmax to put it in).
SINK_KERNELS = ("sdpa", "eager", "longformer", "bigbird")


def validate_attention_options(m: ModelConfig) -> None:
    """Sinks only where a softmax holds them; a sliding window no wider than the context."""
    a = m.attention
    require(
        not a.sinks or a.kernel in SINK_KERNELS,
        f"model.attention.sinks needs a softmax kernel ({', '.join(SINK_KERNELS)}); model.attention.kernel="
        f"'{a.kernel}' has no softmax denominator to hold a sink",
    )
    require(
        not a.sinks or not m.mla.kv_rank,
        "model.attention.sinks is for standard attention; latent attention (model.mla.kv_rank > 0) has no sinks: "
        "set one of them off",
    )
    require(
        a.sliding_window <= m.max_seq_len,
        f"model.attention.sliding_window={a.sliding_window} is larger than the context (model.max_seq_len="
        f"{m.max_seq_len}); every key would be in the window: set it to at most {m.max_seq_len}, or 0 for full "
        "attention",
    )
