"""Falcon-H1 (FalconH1ForCausalLM): every decoder layer runs attention and a Mamba-2 mixer in parallel on the same
normed input, sums their scaled outputs, then a SwiGLU MLP; muP multipliers everywhere.

Each HF layer is one tessera ``H`` layer (tessera/model/parallel_hybrid.py): ``input_layernorm`` ->
``hybrid_norm``, ``self_attn`` -> ``hybrid.attention``, ``mamba`` -> ``hybrid.mamba``, ``pre_ff_layernorm`` ->
``ffn_norm``. The mixer's multipliers (attention in/out, key, SSM in/out, the five ``ssm_multipliers`` over z, x,
B, C, dt) are ``[model.hybrid]``; the embedding, logit and MLP ones ``[model.mup]``; ``mamba_d_ssm`` is
``[model.hybrid].mamba_inner``, ``mamba_rms_norm`` / ``mamba_norm_before_gate`` its ``gated_norm`` /
``norm_before_gate``. Refused, naming the field: Mamba dimensions that do not split (``mamba_d_head *
mamba_n_heads != mamba_d_ssm``, heads not in whole groups), a time-step limit (HF clamps it in the chunked scan but
not when decoding), another activation than silu (HF's Mamba convolution uses ``hidden_act`` too), different
biases on the two Mamba projections, and the remote code's partial layouts (``attn_layer_indices``,
``mamba_use_mlp = false``).
"""

from __future__ import annotations

import math
from typing import Any

from tessera.config import ModelConfig
from tessera.hf.families.common import Family, Rule, copy, decoder_from_hf, decoder_to_hf, ends_rules, fail, get
from tessera.hf.families.common import heads, linear, rope_from_hf, rope_to_hf
from tessera.hf.families.llama import attention_rules, dense_ffn_rules
from tessera.model.parallel_hybrid import mamba_inner

_FAMILY = "falcon_h1"
# [model.hybrid] key -> HF key (the five ssm_multipliers are a list in HF)
_HYBRID = {
    "attention_in": "attention_in_multiplier",
    "attention_out": "attention_out_multiplier",
    "key": "key_multiplier",
    "ssm_in": "ssm_in_multiplier",
    "ssm_out": "ssm_out_multiplier",
}
_SSM = ("ssm_z", "ssm_x", "ssm_b", "ssm_c", "ssm_dt")


def _multipliers(hf: dict[str, Any], key: str, count: int) -> list[float]:
    values = hf.get(key)
    values = [1.0] * count if values is None else list(values)
    if len(values) != count:
        fail(key, values, _FAMILY, f"expected {count} multipliers")
    return [float(v) for v in values]


def _mamba_dims(hf: dict[str, Any]) -> tuple[int, int, int]:
    """(inner width, heads, head width) of the Mamba-2 half, checked."""
    dim, expand = hf["hidden_size"], hf.get("mamba_expand", 2)
    inner = get(hf, "mamba_d_ssm", default=expand * dim)
    n_heads = hf.get("mamba_n_heads", 128)
    head_dim = hf.get("mamba_d_head", "auto")
    head_dim = inner // n_heads if head_dim == "auto" else head_dim
    if head_dim * n_heads != inner:
        fail(
            "mamba_d_head",
            head_dim,
            _FAMILY,
            f"mamba_d_head * mamba_n_heads = {head_dim * n_heads} must equal mamba_d_ssm = {inner}",
        )
    groups = hf.get("mamba_n_groups", 1)
    if n_heads % groups:
        fail("mamba_n_groups", groups, _FAMILY, f"the mamba_n_heads={n_heads} heads must split evenly into groups")
    return inner, n_heads, head_dim


def _number(value: Any) -> float:
    """A JSON number, or transformers' spelling of a non-finite one (``{"__float__": "Infinity"}``)."""
    return float(value["__float__"] if isinstance(value, dict) and "__float__" in value else value)


def _refuse(hf: dict[str, Any]) -> None:
    if hf.get("hidden_act", "silu") != "silu":
        fail("hidden_act", hf["hidden_act"], _FAMILY, "Falcon-H1's Mamba convolution and MLP run silu")
    limit = hf.get("time_step_limit")
    if limit is not None and (_number(limit[0]) != 0.0 or not math.isinf(_number(limit[1]))):
        fail("time_step_limit", limit, _FAMILY, "use the default (0.0, inf)")
    if bool(hf.get("projectors_bias", False)) != bool(hf.get("mamba_proj_bias", False)):
        fail("projectors_bias", hf.get("projectors_bias"), _FAMILY, "it must equal mamba_proj_bias (one key here)")
    if hf.get("attn_layer_indices") is not None:
        fail("attn_layer_indices", hf["attn_layer_indices"], _FAMILY, "every layer must hold attention")
    if not hf.get("mamba_use_mlp", True):
        fail("mamba_use_mlp", hf["mamba_use_mlp"], _FAMILY, "every layer must hold its MLP")


def _hybrid_from_hf(hf: dict[str, Any], inner: int, expand: int) -> dict[str, Any]:
    out: dict[str, Any] = {ours: float(hf.get(theirs, 1.0)) for ours, theirs in _HYBRID.items()}
    out.update(zip(_SSM, _multipliers(hf, "ssm_multipliers", 5)))
    out["mamba_inner"] = 0 if inner == expand * hf["hidden_size"] else inner
    out["gated_norm"] = bool(hf.get("mamba_rms_norm", False))
    out["norm_before_gate"] = bool(hf.get("mamba_norm_before_gate", True))
    return out


def _from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    _refuse(hf)
    base = decoder_from_hf(hf, _FAMILY)
    inner, _, head_dim = _mamba_dims(hf)
    expand = hf.get("mamba_expand", 2)
    gate, down = _multipliers(hf, "mlp_multipliers", 2)
    bias = bool(hf.get("attention_bias", False))
    return {
        **base,
        "norm_eps": float(hf.get("rms_norm_eps", 1e-5)),
        "n_kv_heads": get(hf, "num_key_value_heads", default=hf["num_attention_heads"]),
        **heads(hf, hf["hidden_size"], hf["num_attention_heads"]),
        "ffn_bias": bool(hf.get("mlp_bias", False)),
        "layer_pattern": "H",
        "position": rope_from_hf(hf, _FAMILY),
        "attention": {"qkv_bias": bias, "o_bias": bias},
        "mamba": {
            "version": 2,
            "state": hf.get("mamba_d_state", 256),
            "conv": hf.get("mamba_d_conv", 4),
            "expand": expand,
            "head_dim": head_dim,
            "groups": hf.get("mamba_n_groups", 1),
            "chunk": hf.get("mamba_chunk_size", 256),
            "conv_bias": bool(hf.get("mamba_conv_bias", True)),
            "proj_bias": bool(hf.get("mamba_proj_bias", False)),
        },
        "hybrid": _hybrid_from_hf(hf, inner, expand),
        "mup": {
            "embedding": float(hf.get("embedding_multiplier", 1.0)),
            "head": float(hf.get("lm_head_multiplier", 1.0)),
            "ffn_gate": gate,
            "ffn_down": down,
        },
    }


def _to_hf(cfg: ModelConfig) -> dict[str, Any]:
    m, hy, mup = cfg.mamba, cfg.hybrid, cfg.mup
    inner = mamba_inner(cfg)
    return {
        **decoder_to_hf(cfg),
        **rope_to_hf(cfg),
        "head_dim": cfg.head_dim or cfg.dim // cfg.n_heads,
        "attention_bias": cfg.attention.qkv_bias,
        "mlp_bias": cfg.ffn_bias,
        "mamba_d_ssm": inner,
        "mamba_n_heads": inner // m.head_dim,
        "mamba_d_head": m.head_dim,
        "mamba_n_groups": m.groups,
        "mamba_d_state": m.state,
        "mamba_d_conv": m.conv,
        "mamba_expand": m.expand,
        "mamba_chunk_size": m.chunk,
        "mamba_conv_bias": m.conv_bias,
        "mamba_proj_bias": m.proj_bias,
        "projectors_bias": m.proj_bias,
        "mamba_rms_norm": hy.gated_norm,
        "mamba_norm_before_gate": hy.norm_before_gate,
        **{theirs: getattr(hy, ours) for ours, theirs in _HYBRID.items()},
        "ssm_multipliers": [getattr(hy, key) for key in _SSM],
        "embedding_multiplier": mup.embedding,
        "lm_head_multiplier": mup.head,
        "mlp_multipliers": [mup.ffn_gate, mup.ffn_down],
    }


def _mamba_rules(cfg: ModelConfig, ours: str, theirs: str) -> list[Rule]:
    names = ["A_log", "D", "dt_bias"] + (["norm.weight"] if cfg.hybrid.gated_norm else [])
    rules = [copy(f"{ours}.{n}", f"{theirs}.{n}") for n in names]
    rules += linear(f"{ours}.conv1d", f"{theirs}.conv1d", cfg.mamba.conv_bias)
    rules += linear(f"{ours}.in_proj", f"{theirs}.in_proj", cfg.mamba.proj_bias)
    return rules + linear(f"{ours}.out_proj", f"{theirs}.out_proj", cfg.mamba.proj_bias)


def _rules(cfg: ModelConfig, family: str) -> list[Rule]:
    rules = ends_rules(cfg, "model.embed_tokens.weight", "model.final_layernorm.weight")
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i}", f"model.layers.{i}"
        rules.append(copy(f"{ours}.hybrid_norm.weight", f"{theirs}.input_layernorm.weight"))
        rules += attention_rules(cfg, f"{ours}.hybrid", theirs, attn="self_attn")
        rules += _mamba_rules(cfg, f"{ours}.hybrid.mamba", f"{theirs}.mamba")
        rules.append(copy(f"{ours}.ffn_norm.weight", f"{theirs}.pre_ff_layernorm.weight"))
        rules += dense_ffn_rules(cfg, f"{ours}.feed_forward", f"{theirs}.feed_forward")
    return rules


FAMILIES = {_FAMILY: Family(_FAMILY, "FalconH1ForCausalLM", _from_hf, _to_hf, _rules)}
