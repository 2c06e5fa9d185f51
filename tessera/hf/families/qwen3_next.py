"""Qwen3-Next (Qwen3NextForCausalLM): Gated DeltaNet layers ("D") interleaved with gated full attention ("A"),
zero-centred RMSNorms, partial rotary, and a Qwen2-MoE-style FFN (softmax top-k, one gated shared expert)."""

from __future__ import annotations

from typing import Any

from tessera.config import ModelConfig
from tessera.hf.families.common import Family, HFConversionError, Rule, copy, ends_rules, fail, ffn_hidden, get
from tessera.hf.families.llama import attention_rules, dense_ffn_rules, layer_norm_rules, llama_from_hf, llama_to_hf
from tessera.hf.families.mamba import compress_pattern
from tessera.hf.families.moe import _EXPERT_NAMES, _moe_from_hf, _moe_to_hf
from tessera.hf.families.llama import expert_rules
from tessera.model.block import layer_kind
from tessera.model.moe import is_moe_layer

_KINDS = {"linear_attention": "D", "full_attention": "A"}
_GDN_KEYS = {
    "key_heads": "linear_num_key_heads",
    "value_heads": "linear_num_value_heads",
    "key_head_dim": "linear_key_head_dim",
    "value_head_dim": "linear_value_head_dim",
    "conv": "linear_conv_kernel_dim",
}


def _partial_rotary(hf: dict[str, Any]) -> float:
    params = get(hf, "rope_parameters", "rope_scaling", default={}) or {}
    return float(get(hf, "partial_rotary_factor", default=params.get("partial_rotary_factor", 0.25)))


def _pattern_from_hf(hf: dict[str, Any], family: str) -> str:
    n = hf["num_hidden_layers"]
    interval = hf.get("full_attention_interval", 4)
    types = hf.get("layer_types") or ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    bad = sorted(set(types) - set(_KINDS))
    if bad:
        fail("layer_types", bad[0], family, "supported: linear_attention, full_attention")
    return compress_pattern("".join(_KINDS[t] for t in types))


def _gdn_from_hf(hf: dict[str, Any], family: str) -> dict[str, Any]:
    defaults = {"key_heads": 16, "value_heads": 32, "key_head_dim": 128, "value_head_dim": 128, "conv": 4}
    gdn = {ours: int(hf.get(theirs, defaults[ours])) for ours, theirs in _GDN_KEYS.items()}
    if gdn["value_heads"] % gdn["key_heads"]:
        fail(
            "linear_num_value_heads",
            gdn["value_heads"],
            family,
            f"it must be a multiple of linear_num_key_heads={gdn['key_heads']} (the Gated DeltaNet state dims)",
        )
    return gdn


def qwen3_next_from_hf(hf: dict[str, Any], family: str = "qwen3_next") -> dict[str, Any]:
    """The ModelConfig keys of a Qwen3-Next-style text config (Qwen3.5's too: ``family`` names it in errors)."""
    rope_free = {k: v for k, v in hf.items() if k != "partial_rotary_factor"}
    params = dict(get(hf, "rope_parameters", "rope_scaling", default={}) or {})
    params.pop("partial_rotary_factor", None)
    rope_free["rope_parameters" if hf.get("rope_parameters") is not None else "rope_scaling"] = params or None
    out = llama_from_hf(rope_free, family)
    bias = bool(hf.get("attention_bias", False))
    out["norm"] = "zero_centered_rmsnorm"
    out["attention"].update(qkv_bias=bias, o_bias=bias, qk_norm=True, output_gate=True)
    out["position"]["rotary_fraction"] = _partial_rotary(hf)
    out["layer_pattern"] = _pattern_from_hf(hf, family)
    out["gdn"] = _gdn_from_hf(hf, family)
    if int(hf.get("num_experts", 0) or 0) > 0:
        out["moe"] = _moe_from_hf(hf, family, hf["moe_intermediate_size"])
        shared = int(hf.get("shared_expert_intermediate_size", 512))
        if not shared:
            fail("shared_expert_intermediate_size", 0, family)
        out["moe"].update(shared_experts=1, shared_ffn_hidden=shared, shared_gate=True)
    return out


def qwen3_next_to_hf(cfg: ModelConfig, family: str = "qwen3_next") -> dict[str, Any]:
    """The HF config of a Qwen3-Next-style model (Qwen3.5 removes the keys its text config does not have)."""
    a = cfg.attention
    if not (cfg.norm == "zero_centered_rmsnorm" and a.qk_norm and a.output_gate and a.qkv_bias == a.o_bias):
        raise HFConversionError(
            f"{family} needs model.norm='zero_centered_rmsnorm', model.attention.qk_norm=true, "
            "model.attention.output_gate=true and qkv_bias equal to o_bias"
        )
    hf = llama_to_hf(cfg, family)
    fraction = cfg.position.rotary_fraction
    hf["rope_parameters"] = {**hf["rope_parameters"], "partial_rotary_factor": fraction}
    hf.update(partial_rotary_factor=fraction, attention_bias=a.qkv_bias)
    hf["layer_types"] = [
        "linear_attention" if layer_kind(cfg, i) == "D" else "full_attention" for i in range(cfg.n_layers)
    ]
    hf.update({theirs: getattr(cfg.gdn, ours) for ours, theirs in _GDN_KEYS.items()})
    if not cfg.moe.experts:
        return {**hf, "num_experts": 0, "mlp_only_layers": []}
    moe = cfg.moe
    if moe.shared_experts != 1 or not moe.shared_gate:
        raise HFConversionError(
            f"{family} MoE layers have one gated shared expert: set model.moe.shared_experts=1 "
            "and model.moe.shared_gate=true"
        )
    shared = moe.shared_ffn_hidden or moe.ffn_hidden or ffn_hidden(cfg)
    return {**hf, **_moe_to_hf(cfg), "shared_expert_intermediate_size": shared}


def _gdn_rules(ours: str, theirs: str) -> list[Rule]:
    names = ("in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "dt_bias", "A_log", "norm.weight")
    return [copy(f"{ours}.{n}", f"{theirs}.{n}") for n in (*names, "out_proj.weight")]


def qwen3_next_rules(cfg: ModelConfig, family: str) -> list[Rule]:
    """Weight names of Qwen3-Next (and, after Qwen3.5's projections are fused, of Qwen3.5)."""
    rules = ends_rules(cfg, "model.embed_tokens.weight", "model.norm.weight")
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i}", f"model.layers.{i}"
        mixer_norm = "gdn_norm" if layer_kind(cfg, i) == "D" else "attention_norm"
        rules += layer_norm_rules(ours, theirs, mixer_norm)
        if layer_kind(cfg, i) == "D":
            rules += _gdn_rules(f"{ours}.gdn", f"{theirs}.linear_attn")
        else:
            rules += attention_rules(cfg, ours, theirs)
        if not is_moe_layer(cfg, i):
            rules += dense_ffn_rules(cfg, f"{ours}.feed_forward", f"{theirs}.mlp")
            continue
        rules.append(copy(f"{ours}.moe.router.weight", f"{theirs}.mlp.gate.weight"))
        rules += expert_rules(f"{ours}.moe", f"{theirs}.mlp", cfg.moe.experts, _EXPERT_NAMES)
        rules += dense_ffn_rules(cfg, f"{ours}.moe.shared", f"{theirs}.mlp.shared_expert", bias=False)
        rules.append(copy(f"{ours}.moe.shared_gate.weight", f"{theirs}.mlp.shared_expert_gate.weight"))
    return rules


# The released checkpoints carry an MTP head HF does not load either.
QWEN3_NEXT_IGNORED = ("rotary_emb.inv_freq", "mtp.")

FAMILIES = {
    "qwen3_next": Family(
        "qwen3_next", "Qwen3NextForCausalLM", qwen3_next_from_hf, qwen3_next_to_hf, qwen3_next_rules, QWEN3_NEXT_IGNORED
    ),
}
