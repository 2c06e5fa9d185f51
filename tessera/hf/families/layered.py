"""What the per-layer-pattern families share (Gemma 3, OLMo 3, SmolLM3): HF ``layer_types`` as a
``model.layer_pattern``, and RoPE parameters given per layer type (transformers 5)."""

from __future__ import annotations

from typing import Any

from tessera.config import ModelConfig
from tessera.hf.families.common import fail, rope_from_hf, rope_to_hf
from tessera.model.mixers import layer_kind

_LETTER = {"sliding_attention": "A", "full_attention": "G"}


def pattern_from_types(types: list[str], family: str) -> str:
    """HF ``layer_types`` -> the shortest ``model.layer_pattern`` that tiles them ("" when every layer is full)."""
    bad = sorted(set(types) - set(_LETTER))
    if bad:
        fail("layer_types", bad[0], family, "supported: sliding_attention, full_attention")
    full = "".join(_LETTER[t] for t in types)
    if set(full) == {"G"}:
        return ""
    n = len(full)
    period = next(p for p in range(1, n + 1) if n % p == 0 and full[:p] * (n // p) == full)
    return full[:period]


def types_of(cfg: ModelConfig) -> list[str]:
    """Each layer's HF ``layer_types`` entry: 'G' layers (and every layer without a window) full, others sliding."""
    sliding = cfg.attention.sliding_window > 0
    return [
        "sliding_attention" if sliding and layer_kind(cfg, i) != "G" else "full_attention" for i in range(cfg.n_layers)
    ]


def layer_rope_params(hf: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``rope_parameters`` by layer type (transformers 5), or the one set of 4.x / a flat dict for both."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        return {kind: dict(params.get(kind) or {}) for kind in ("full_attention", "sliding_attention")}
    return {"full_attention": dict(params), "sliding_attention": dict(params)}


def position_from_hf(hf: dict[str, Any], pattern: str, family: str, local_theta: float | None = None) -> dict[str, Any]:
    """[model.position]: the full layers' RoPE as rope_theta (+ scaling); the sliding layers' base as
    local_rope_theta when there are both (their RoPE must be plain)."""
    params = layer_rope_params(hf)
    full, sliding = params["full_attention"], params["sliding_attention"]
    if "G" not in pattern:  # no full layer: the sliding layers' RoPE is every layer's
        full = sliding if pattern else full
        return rope_from_hf({**hf, "rope_parameters": full, "rope_scaling": None}, family)
    out = rope_from_hf({**hf, "rope_parameters": full, "rope_scaling": None}, family)
    if sliding.get("rope_type", "default") != "default":
        fail("rope_parameters.sliding_attention.rope_type", sliding["rope_type"], family, "local layers: default")
    out["local_rope_theta"] = float(sliding.get("rope_theta") or local_theta or out["rope_theta"])
    return out


def position_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """``rope_parameters`` by layer type: the 'G' layers' RoPE, and the local layers' own (or the same)."""
    full = rope_to_hf(cfg)["rope_parameters"]
    local = cfg.position.local_rope_theta
    sliding = {"rope_type": "default", "rope_theta": local} if local else dict(full)
    return {"rope_parameters": {"full_attention": full, "sliding_attention": sliding}}
