"""Nemotron-H (NemotronHForCausalLM): a Mamba-2 + attention hybrid whose layers each hold one sublayer - a Mamba-2
mixer ("M"), attention without positions ("*"), or a squared-ReLU MLP ("-") - behind their own RMSNorm.

A tessera block is a mixer and, optionally, the FFN after it, with the same pre-norm residuals, so each Mamba or
attention layer of HF becomes one tessera layer together with the MLP layer that follows it: Mamba + MLP is an
``M`` layer (``[model.mamba].ffn = true``), a Mamba layer with no MLP after it an ``m`` layer, attention + MLP an
``A`` layer. Layer ``j`` of tessera names the HF layers it came from (see :func:`hf_layers`). The Mamba-2 mixer is
tessera's (grouped gated norm, the time step floored at ``time_step_min``: ``[model.mamba].dt_min``); MoE layers
("E", Nemotron-3) and layer orders that do not pair (an MLP after an MLP, attention with no MLP after it) are
refused, naming the layer.
"""

from __future__ import annotations

from typing import Any

from tessera.config import ModelConfig
from tessera.hf.families.common import Family, HFConversionError, Rule, copy, ends_rules, fail, ffn_hidden, get
from tessera.hf.families.common import heads, linear
from tessera.hf.families.llama import attention_rules
from tessera.hf.families.mamba import compress_pattern, mixer_rules
from tessera.model.block import layer_kind

_FAMILY = "nemotron_h"
_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
_LEGACY = {"mamba": "linear_attention", "attention": "full_attention"}
_ACT_IN = {"relu2": "relu2", "relu": "relu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}
_ACT_OUT = {ours: theirs for theirs, ours in _ACT_IN.items()}
_PREFIX = "backbone"  # the released checkpoints' (and transformers' saved) prefix; transformers renames it on load


def _layer_types(hf: dict[str, Any]) -> list[str]:
    types = get(hf, "layers_block_type", "layer_types")
    if types is None:
        pattern = hf.get("hybrid_override_pattern", "M-M*-")
        bad = [c for c in pattern if c not in _PATTERN]
        if bad:
            fail("hybrid_override_pattern", pattern, _FAMILY, f"{bad[0]!r} is not one of M, *, -, E")
        types = [_PATTERN[c] for c in pattern]
    return [_LEGACY.get(t, t) for t in types]


def pair_layers(types: list[str]) -> list[tuple[str, int, int | None]]:
    """HF layer types -> tessera layers (letter, HF index of the mixer, HF index of the MLP after it or None)."""
    if "moe" in types:
        fail(f"layers_block_type[{types.index('moe')}]", "moe", _FAMILY, "MoE layers (Nemotron-3) are not supported")
    layers, i = [], 0
    while i < len(types):
        kind = types[i]
        if kind not in ("linear_attention", "full_attention"):
            hint = "supported: linear_attention, full_attention, and mlp right after one of them"
            fail(f"layers_block_type[{i}]", kind, _FAMILY, hint)
        ffn = i + 1 if i + 1 < len(types) and types[i + 1] == "mlp" else None
        if kind == "full_attention" and ffn is None:
            fail(f"layers_block_type[{i}]", kind, _FAMILY, "an attention layer must be followed by an mlp layer")
        layers.append(("A" if kind == "full_attention" else "M" if ffn is not None else "m", i, ffn))
        i += 1 if ffn is None else 2
    return layers


def hf_layers(cfg: ModelConfig) -> list[tuple[str, int, int | None]]:
    """tessera's layers as (letter, HF mixer index, HF MLP index or None), in order."""
    out, i = [], 0
    for j in range(cfg.n_layers):
        kind = layer_kind(cfg, j)
        if kind not in ("M", "m", "A"):
            raise HFConversionError(
                f"model.layer_pattern letter {kind!r} (layer {j}) cannot be expressed in nemotron_h: use M, m and A"
            )
        ffn = kind == "A" or (kind == "M" and cfg.mamba.ffn)
        out.append((kind, i, i + 1 if ffn else None))
        i += 2 if ffn else 1
    return out


def _mamba_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    dim, heads_, head_dim = hf["hidden_size"], hf.get("mamba_num_heads", 128), hf.get("mamba_head_dim", 64)
    if (heads_ * head_dim) % dim:
        fail(
            "mamba_num_heads",
            heads_,
            _FAMILY,
            f"mamba_num_heads * mamba_head_dim = {heads_ * head_dim} must be a whole multiple of hidden_size={dim} "
            "(tessera's Mamba-2 inner width is expand * dim)",
        )
    groups = hf.get("n_groups", 8)
    if heads_ % groups:
        fail("n_groups", groups, _FAMILY, f"the mamba_num_heads={heads_} heads must split evenly into the groups")
    if hf.get("mamba_hidden_act", "silu") != "silu":
        fail("mamba_hidden_act", hf["mamba_hidden_act"], _FAMILY)
    return {
        "version": 2,
        "state": hf.get("ssm_state_size", 128),
        "conv": hf.get("conv_kernel", 4),
        "expand": heads_ * head_dim // dim,
        "head_dim": head_dim,
        "groups": groups,
        "chunk": hf.get("chunk_size", 128),
        "conv_bias": bool(hf.get("use_conv_bias", True)),
        "proj_bias": bool(hf.get("use_bias", False)),
        "ffn": True,
        "dt_min": float(hf.get("time_step_min", 0.001)),
    }


def _from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("sliding_window") is not None:
        fail("sliding_window", hf["sliding_window"], _FAMILY)
    act = hf.get("mlp_hidden_act", "relu2")
    if act not in _ACT_IN:
        fail("mlp_hidden_act", act, _FAMILY, f"supported: {', '.join(_ACT_IN)}")
    layers = pair_layers(_layer_types(hf))
    dim, n_heads = hf["hidden_size"], hf.get("num_attention_heads", 32)
    return {
        "vocab_size": hf["vocab_size"],
        "dim": dim,
        "n_layers": len(layers),
        "n_heads": n_heads,
        "n_kv_heads": get(hf, "num_key_value_heads", default=n_heads),
        **heads({"head_dim": hf.get("head_dim", 128)}, dim, n_heads),
        "ffn_hidden": hf.get("intermediate_size", 21504),
        "activation": _ACT_IN[act],
        "ffn_bias": bool(hf.get("mlp_bias", False)),
        "norm": "rmsnorm",
        "norm_eps": float(hf.get("layer_norm_epsilon", 1e-5)),
        "max_seq_len": int(hf.get("max_position_embeddings", 4096)),
        "tie_embeddings": False,  # NemotronHForCausalLM never ties its lm_head, whatever tie_word_embeddings says
        "layer_pattern": compress_pattern("".join(letter for letter, _, _ in layers)),
        "position": {"kind": "none"},
        # transformers builds the attention projections bias-free whatever attention_bias says
        "attention": {"qkv_bias": False, "o_bias": False},
        "mamba": _mamba_from_hf(hf),
    }


def _layer_types_of(cfg: ModelConfig) -> list[str]:
    types: list[str] = []
    for letter, _, ffn in hf_layers(cfg):
        types += ["full_attention" if letter == "A" else "linear_attention"] + (["mlp"] if ffn is not None else [])
    return types


def _to_hf(cfg: ModelConfig) -> dict[str, Any]:
    if cfg.moe.experts:
        raise HFConversionError("model.moe cannot be expressed in nemotron_h: tessera maps its dense layers only")
    m = cfg.mamba
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "layers_block_type": _layer_types_of(cfg),
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads or cfg.n_heads,
        "head_dim": cfg.head_dim or cfg.dim // cfg.n_heads,
        "attention_bias": False,
        "intermediate_size": ffn_hidden(cfg),
        "mlp_hidden_act": _ACT_OUT.get(cfg.activation, cfg.activation),
        "mlp_bias": cfg.ffn_bias,
        "layer_norm_epsilon": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": False,
        "mamba_num_heads": m.expand * cfg.dim // m.head_dim,
        "mamba_head_dim": m.head_dim,
        "ssm_state_size": m.state,
        "n_groups": m.groups,
        "conv_kernel": m.conv,
        "expand": m.expand,
        "chunk_size": m.chunk,
        "use_conv_bias": m.conv_bias,
        "use_bias": m.proj_bias,
        "mamba_hidden_act": "silu",
        "time_step_min": m.dt_min,
        "sliding_window": None,
    }


def _ffn_rules(cfg: ModelConfig, ours: str, theirs: str) -> list[Rule]:
    return [r for p in ("up_proj", "down_proj") for r in linear(f"{ours}.{p}", f"{theirs}.{p}", cfg.ffn_bias)]


def _rules(cfg: ModelConfig, family: str) -> list[Rule]:
    rules = ends_rules(cfg, f"{_PREFIX}.embeddings.weight", f"{_PREFIX}.norm_f.weight")
    for j, (letter, mixer, ffn) in enumerate(hf_layers(cfg)):
        ours, theirs = f"layers.{j}", f"{_PREFIX}.layers.{mixer}"
        if letter == "A":
            rules.append(copy(f"{ours}.attention_norm.weight", f"{theirs}.norm.weight"))
            rules += attention_rules(cfg, ours, theirs, attn="mixer")
        else:
            rules.append(copy(f"{ours}.mamba_norm.weight", f"{theirs}.norm.weight"))
            rules += mixer_rules(cfg, f"{ours}.mamba", f"{theirs}.mixer")
        if ffn is not None:
            rules.append(copy(f"{ours}.ffn_norm.weight", f"{_PREFIX}.layers.{ffn}.norm.weight"))
            rules += _ffn_rules(cfg, f"{ours}.feed_forward", f"{_PREFIX}.layers.{ffn}.mixer")
    return rules


def _prepare(hf: dict[str, Any], cfg: ModelConfig, tensors: dict[str, Any]) -> None:
    """Checkpoints written under transformers' own module names (``model.``) read like the released ones."""
    for key in [k for k in tensors if k.startswith("model.")]:
        tensors[f"{_PREFIX}.{key[len('model.') :]}"] = tensors.pop(key)


FAMILIES = {"nemotron_h": Family(_FAMILY, "NemotronHForCausalLM", _from_hf, _to_hf, _rules, prepare=_prepare)}
