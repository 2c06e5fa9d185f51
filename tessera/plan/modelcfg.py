"""Reading [model] keys that moved into sub-sections (``moe_experts`` -> ``moe.experts``), either way."""

from __future__ import annotations

from typing import Any

_FLAT = {
    ("attention", "kernel"): "attention",
    ("attention", "dropout"): "attn_dropout",
    ("position", "kind"): "position",
}


def _sub(cfg: Any, section: str, key: str) -> Any:
    group = getattr(cfg, section, None)
    if group is not None and not isinstance(group, str) and hasattr(group, key):
        return getattr(group, key)
    return getattr(cfg, _FLAT.get((section, key), f"{section}_{key}"))


def moe(cfg: Any, key: str) -> Any:
    """``model.moe.<key>`` (or the flat ``model.moe_<key>``)."""
    return _sub(cfg, "moe", key)


def attention_kernel(cfg: Any) -> str:
    """``model.attention.kernel`` (or the flat ``model.attention``)."""
    return _sub(cfg, "attention", "kernel")


def attention_dropout(cfg: Any) -> float:
    """``model.attention.dropout`` (or the flat ``model.attn_dropout``)."""
    return _sub(cfg, "attention", "dropout")


def position_kind(cfg: Any) -> str:
    """``model.position.kind`` (or the flat ``model.position``)."""
    return _sub(cfg, "position", "kind")
