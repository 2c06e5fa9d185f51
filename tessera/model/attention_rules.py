"""The sliding window as a registered option: its rule (no wider than the context) and its compatibility row."""

from __future__ import annotations

from typing import Any

from tessera import registry
from tessera.config.checks import require


def check_window(m: Any) -> None:
    """A sliding window no wider than the context (a wider one would hold every key: say 0 for full attention)."""
    a = m.attention
    require(
        a.sliding_window <= m.max_seq_len,
        f"model.attention.sliding_window={a.sliding_window} is larger than the context (model.max_seq_len="
        f"{m.max_seq_len}); every key would be in the window: set it to at most {m.max_seq_len}, or 0 for full "
        "attention",
    )


SLIDING_WINDOW = registry.option(
    name="sliding_window",
    feature="sliding-window attention (per layer with layer_pattern A/G)",
    keys=("model.attention.sliding_window", "model.layer_pattern"),
    uses=lambda m: m.attention.sliding_window > 0,
    unsupported={},
    checks=(check_window,),
)
