"""Llama 4, text only (HF ``Llama4ForCausalLM``, ``model_type = "llama4_text"``).

What it is built from: iRoPE (``no_rope_layers``: NoPE on every 4th layer, ``position.nope_layers``), chunked
attention on the RoPE layers ('A' letters of ``layer_pattern`` with ``attention.chunk_size``; the NoPE layers
are global 'G'), the weightless QK L2 norm on the RoPE layers (``attention.qk_l2_norm``), temperature tuning on
the NoPE layers (``attention.temperature_*``), and MoE layers every ``interleave_moe_layer_step`` (top-1 sigmoid
routing that scales the expert input, ``moe.scale_input``, plus an ungated shared expert; dense layers are
``intermediate_size_mlp`` wide, experts ``intermediate_size``). HF rotates interleaved channel pairs (complex
RoPE); tessera rotates halves, so each RoPE layer's q/k rows are de-interleaved on import and interleaved back on
export. The experts' ``gate_up_proj`` holds gate then up (the ``halves`` rule). The released multimodal
checkpoints (``model_type = "llama4"``) import their text model; they export as ``llama4_text``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from tessera.config import ModelConfig
from tessera.hf.families.common import Family, HFConversionError, Rule, copy, ends_rules, fail, ffn_hidden
from tessera.hf.families.llama import dense_ffn_rules, llama_from_hf, llama_layer_rules, llama_to_hf
from tessera.model.layer_patterns import nope_layers
from tessera.model.moe import is_moe_layer

FAMILY = "llama4_text"
_TYPES = {"chunked_attention": "A", "full_attention": "G"}
_THETA = 500000.0  # transformers' Llama4TextConfig.default_theta


def _period(pattern: str) -> str:
    """The shortest prefix of ``pattern`` that tiles it ("AAAGAAAG" -> "AAAG")."""
    n = len(pattern)
    return next(pattern[:p] for p in range(1, n + 1) if n % p == 0 and pattern[:p] * (n // p) == pattern)


def _layers_from_hf(hf: dict[str, Any], out: dict[str, Any]) -> None:
    """``no_rope_layers``, ``attention_chunk_size`` and ``layer_types`` -> NoPE layers and an A/G layer_pattern."""
    n = hf["num_hidden_layers"]
    interval = int(hf.get("no_rope_layer_interval") or 4)
    uses_rope = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
    out["position"]["nope_layers"] = ",".join(str(i) for i in range(n) if not uses_rope[i])
    chunk = int(hf.get("attention_chunk_size") or 0)
    if chunk >= hf["max_position_embeddings"]:
        chunk = 0  # one chunk holds every position: plain causal attention
    types = hf.get("layer_types") or [
        "chunked_attention" if uses_rope[i] and chunk else "full_attention" for i in range(n)
    ]
    bad = sorted(set(types) - set(_TYPES))
    if bad:
        fail("layer_types", bad[0], FAMILY, "supported: chunked_attention, full_attention")
    pattern = "".join(_TYPES[t] for t in types[:n]) if chunk else ""
    out["attention"]["chunk_size"] = chunk if "A" in pattern else 0
    out["layer_pattern"] = "" if set(pattern) <= {"A"} else _period(pattern)


def _moe_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """Experts on every ``interleave_moe_layer_step``-th layer (or the ``moe_layers`` of that form)."""
    n, step = hf["num_hidden_layers"], int(hf.get("interleave_moe_layer_step") or 1)
    layers = hf.get("moe_layers")
    if layers is not None and list(layers) != list(range(step - 1, n, step)):
        fail("moe_layers", layers, FAMILY, f"tessera puts MoE on every n-th layer (range({step - 1}, {n}, {step}))")
    return {
        "experts": hf["num_local_experts"],
        "top_k": hf["num_experts_per_tok"],
        "every": step,
        "router": "sigmoid",
        "norm_topk": False,
        "scale_input": True,
        "ffn_hidden": hf["intermediate_size"],
        "shared_experts": 1,
        "shared_ffn_hidden": hf["intermediate_size"],
        "aux_loss_coef": 0.0,  # Llama4ForCausalLM's loss has no balancing term
    }


def llama4_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig keys of an HF Llama 4 text config."""
    if hf.get("hidden_act", "silu") != "silu":
        fail("hidden_act", hf["hidden_act"], FAMILY)
    out = llama_from_hf({"rope_theta": _THETA, **hf, "intermediate_size": hf["intermediate_size_mlp"]}, FAMILY)
    _layers_from_hf(hf, out)
    nope = bool(out["position"]["nope_layers"])
    out["attention"].update(
        qk_l2_norm=bool(hf.get("use_qk_norm", True)),
        temperature_tuning=bool(hf.get("attn_temperature_tuning", True)) and nope,
        temperature_floor=int(hf.get("floor_scale", 8192)),
        temperature_scale=float(hf.get("attn_scale", 0.1)),
    )
    out["moe"] = _moe_from_hf(hf)
    return out


def llama4_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The HF Llama 4 text config of a tessera config (exactness is checked by the caller)."""
    a, moe, nope = cfg.attention, cfg.moe, nope_layers(cfg)
    pattern = cfg.layer_pattern or "A"
    chunked = [bool(a.chunk_size) and pattern[i % len(pattern)] == "A" for i in range(cfg.n_layers)]
    return {
        **llama_to_hf(cfg, FAMILY),
        "intermediate_size": moe.ffn_hidden or ffn_hidden(cfg),
        "intermediate_size_mlp": ffn_hidden(cfg),
        "attention_bias": a.qkv_bias,
        "no_rope_layers": [0 if i in nope else 1 for i in range(cfg.n_layers)],
        "attention_chunk_size": a.chunk_size or None,
        "layer_types": ["chunked_attention" if c else "full_attention" for c in chunked],
        "use_qk_norm": a.qk_l2_norm,
        "attn_temperature_tuning": a.temperature_tuning,
        "floor_scale": a.temperature_floor,
        "attn_scale": a.temperature_scale,
        "num_local_experts": moe.experts,
        "num_experts_per_tok": moe.top_k,
        "interleave_moe_layer_step": moe.every,
        "moe_layers": [i for i in range(cfg.n_layers) if is_moe_layer(cfg, i)],
    }


def _moe_rules(ours: str, theirs: str) -> list[Rule]:
    """Router, the expert banks (HF's gate_up_proj: gate then up) and the shared expert."""
    rules = [
        copy(f"{ours}.router.weight", f"{theirs}.router.weight"),
        Rule((f"{ours}.experts.gate_proj", f"{ours}.experts.up_proj"), (f"{theirs}.experts.gate_up_proj",), "halves"),
        copy(f"{ours}.experts.down_proj", f"{theirs}.experts.down_proj"),
    ]
    return rules + [copy(f"{ours}.shared.{p}.weight", f"{theirs}.shared_expert.{p}.weight") for p in _PROJ]


_PROJ = ("gate_proj", "up_proj", "down_proj")


def llama4_rules(cfg: ModelConfig, family: str) -> list[Rule]:
    """Weight names of Llama 4's text model."""
    rules = ends_rules(cfg, "model.embed_tokens.weight", "model.norm.weight")
    for i in range(cfg.n_layers):
        ours, theirs, layer = llama_layer_rules(cfg, i)
        rules += layer
        if is_moe_layer(cfg, i):
            rules += _moe_rules(f"{ours}.moe", f"{theirs}.feed_forward")
        else:
            rules += dense_ffn_rules(cfg, f"{ours}.feed_forward", f"{theirs}.feed_forward")
    return rules


def rope_pair_order(rows: int, head: int, inverse: bool) -> torch.Tensor:
    """Row order taking each ``head``-row block from interleaved pairs (x0, x1), (x2, x3), ... to halves
    (x0, x2, ...), (x1, x3, ...); ``inverse``: back."""
    block = torch.arange(head).view(head // 2, 2).t().reshape(-1)  # halves position j <- pair row block[j]
    order = (torch.arange(0, rows, head)[:, None] + block[None]).reshape(-1)
    return torch.argsort(order) if inverse else order


def _rope_rows(cfg: ModelConfig, tensors: dict[str, torch.Tensor], inverse: bool) -> None:
    """Reorder the q/k projection rows (weights, biases) of every RoPE layer in place."""
    head, nope = cfg.head_dim or cfg.dim // cfg.n_heads, nope_layers(cfg)
    for name in list(tensors):
        parts = name.removeprefix(_LANGUAGE).split(".")
        if len(parts) > 4 and parts[1] == "layers" and parts[4] in ("q_proj", "k_proj") and int(parts[2]) not in nope:
            t = tensors[name]
            tensors[name] = t[rope_pair_order(t.shape[0], head, inverse)]


def _prepare(hf: dict[str, Any], cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    _rope_rows(cfg, tensors, inverse=False)


def _finish(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    _rope_rows(cfg, tensors, inverse=True)


# The released checkpoints (Llama4ForConditionalGeneration, model_type "llama4"): the text model's tensors under
# this prefix, its config as text_config; the vision tower and projector are not read.
_LANGUAGE = "language_model."
_VISION = ("vision_model.", "multi_modal_projector.")


def _composite_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(hf.get("text_config"), dict):
        fail("text_config", hf.get("text_config"), "llama4", "a released Llama 4 config has its text model there")
    text = {"tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)), **hf["text_config"]}
    return llama4_from_hf(text)


def _composite_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    raise HFConversionError("tessera holds Llama 4's text model only (no vision tower): export it as llama4_text")


def _composite_rules(cfg: ModelConfig, family: str) -> list[Rule]:
    """The text model's rules with HF's names under ``language_model.``."""
    return [dataclasses.replace(r, theirs=tuple(_LANGUAGE + t for t in r.theirs)) for r in llama4_rules(cfg, family)]


FAMILIES = {
    FAMILY: Family(
        FAMILY, "Llama4ForCausalLM", llama4_from_hf, llama4_to_hf, llama4_rules, ("rotary_emb",), _prepare, _finish
    ),
    "llama4": Family(
        "llama4",
        "Llama4ForConditionalGeneration",
        _composite_from_hf,
        _composite_to_hf,
        _composite_rules,
        ("rotary_emb", *_VISION),
        _prepare,
    ),
}
