"""OLMo 3 (HF ``Olmo3ForCausalLM``): 3 sliding-window layers to 1 full, the sublayer outputs normed before the
residual add ("reordered" norms, as OLMo 2), QK-norm over all heads' channels, unscaled RoPE on the local layers."""

from __future__ import annotations

from typing import Any

from tessera.config import ModelConfig
from tessera.hf.families.common import Family, Rule, fail
from tessera.hf.families.layered import pattern_from_types, position_from_hf, position_to_hf, types_of
from tessera.hf.families.llama import llama_from_hf, llama_rules, llama_to_hf

FAMILY = "olmo3"


def olmo3_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig keys of an HF OLMo 3 config."""
    if hf.get("clip_qkv") is not None:
        fail("clip_qkv", hf["clip_qkv"], FAMILY)
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(n)]
    pattern = pattern_from_types(types, FAMILY)
    out = llama_from_hf({**hf, "rope_parameters": None, "rope_scaling": None}, FAMILY)
    bias = bool(hf.get("attention_bias", False))
    out["attention"].update(qk_norm=True, qk_norm_scope="all", qkv_bias=bias, o_bias=bias)
    out["attention"]["sliding_window"] = int(hf.get("sliding_window") or 0) if pattern else 0
    out.update(norm_position="reordered", layer_pattern=pattern, position=position_from_hf(hf, pattern, FAMILY))
    return out


def olmo3_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The HF OLMo 3 config of a tessera config (exactness is checked by the caller)."""
    hf = {k: v for k, v in llama_to_hf(cfg, FAMILY).items() if k not in ("rope_theta", "rope_scaling")}
    return {
        **hf,
        "attention_bias": cfg.attention.qkv_bias,
        "sliding_window": cfg.attention.sliding_window or None,
        "layer_types": types_of(cfg),
        **position_to_hf(cfg),
    }


# OLMo 2/3 name each block's two norms after the sublayer they follow: Llama's names, moved one along.
_NORMS = {"input_layernorm": "post_attention_layernorm", "post_attention_layernorm": "post_feedforward_layernorm"}


def _moved(rule: Rule) -> Rule:
    *path, module, param = rule.theirs[0].split(".")
    return Rule(rule.ours, (".".join([*path, _NORMS.get(module, module), param]),), rule.kind)


def olmo3_rules(cfg: ModelConfig, family: str) -> list[Rule]:
    """Weight names of OLMo 2/3: Llama's, with a norm after each sublayer and q/k norms over all heads."""
    return [_moved(rule) for rule in llama_rules(cfg, family)]


FAMILIES = {FAMILY: Family(FAMILY, "Olmo3ForCausalLM", olmo3_from_hf, olmo3_to_hf, olmo3_rules, ("rotary_emb",))}
