"""Llama 4's per-layer attention options around iRoPE, as registered options.

- ``model.attention.qk_l2_norm``: each head's queries and keys divided by their root mean square (no weight,
  eps ``model.norm_eps``; HF ``Llama4TextL2Norm``) on the RoPE layers only, after the rotary (a rotation keeps
  the mean square, so the order does not matter but is HF's).
- ``model.attention.temperature_tuning``: on the NoPE layers (``model.position.nope_layers``) the queries at
  position ``p`` are scaled by ``log(floor((p + 1) / temperature_floor) + 1) * temperature_scale + 1``
  (Nakanishi 2025, arXiv 2501.19399; HF ``attn_temperature_tuning``, ``floor_scale``, ``attn_scale``), so
  long-range NoPE attention does not flatten out. ``p`` counts from the start of the (cached) sequence.

:func:`layer_options` sets both on one layer's attention module when it is built.
"""

from __future__ import annotations

from typing import Any

import torch

from tessera import registry
from tessera.config import ModelConfig
from tessera.config.checks import require
from tessera.model.layer_patterns import nope_layers


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x`` over the root mean square of its last dimension, in float32 and cast back (HF ``Llama4TextL2Norm``)."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


def temperature(start: int, length: int, floor: int, scale: float, device: torch.device) -> torch.Tensor:
    """(length, 1) query scales of positions ``start .. start + length - 1``."""
    positions = torch.arange(start, start + length, device=device).float()
    return (torch.log1p(torch.floor((positions + 1.0) / floor)) * scale + 1.0)[:, None]


def layer_options(module: Any, cfg: ModelConfig, layer_id: int) -> Any:
    """``module`` (an Attention) with layer ``layer_id``'s QK L2 norm (RoPE layers) and temperature (NoPE layers)."""
    nope = layer_id in nope_layers(cfg)
    a = cfg.attention
    module.qk_l2_eps = cfg.norm_eps if a.qk_l2_norm and not nope else 0.0
    module.temperature = (a.temperature_floor, a.temperature_scale) if a.temperature_tuning and nope else None
    return module


def check_qk_l2_norm(m: Any) -> None:
    """The L2 norm of Llama 4 is weightless and replaces the learned QK-norm; it needs RoPE layers."""
    if not m.attention.qk_l2_norm:
        return
    require(
        not m.attention.qk_norm and not m.mla.kv_rank and m.arch == "decoder" and m.position.kind == "rope",
        "model.attention.qk_l2_norm (Llama 4's weightless QK norm on RoPE layers) needs a RoPE decoder of standard "
        "attention without model.attention.qk_norm",
    )


def check_temperature(m: Any) -> None:
    """Temperature tuning scales the queries of NoPE layers: there must be some, and a positive floor."""
    a = m.attention
    if not a.temperature_tuning:
        return
    require(
        a.temperature_floor > 0,
        f"model.attention.temperature_floor must be positive, got {a.temperature_floor}",
    )
    require(
        bool(m.position.nope_layers) and not m.mla.kv_rank,
        "model.attention.temperature_tuning scales the queries of NoPE layers: set model.position.nope_layers "
        '(e.g. "3,7,11")',
    )


_CP = "context parallelism hands each rank scattered positions; run model.attention.{key} without parallel.cp"


def _unsupported(key: str) -> dict[str, str]:
    """cp only: tp2 (+SP) and pp2 match one process (tests/integration/test_llama4_parallel.py)."""
    return {"cp": _CP.format(key=key)}


registry.register_options(
    {
        "qk_l2_norm": ("QK L2 norm on RoPE layers (Llama 4)", "model.attention.qk_l2_norm", check_qk_l2_norm),
        "temperature_tuning": (
            "attention temperature tuning on NoPE layers (Llama 4)",
            "model.attention.temperature_tuning",
            check_temperature,
        ),
    },
    unsupported={"qk_l2_norm": _unsupported("qk_l2_norm"), "temperature_tuning": _unsupported("temperature_tuning")},
)
