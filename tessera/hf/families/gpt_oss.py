"""gpt-oss (GptOssForCausalLM): attention sinks, alternating windowed / full layers, biased clamped-SwiGLU experts.

Every layer is MoE: a biased router (softmax over the top-k logits) and experts whose gate and up projections
are one ``gate_up_proj`` (E, dim, 2 x hidden) with gate and up channels *alternating* (gate = ``[..., ::2]``),
mapped by the ``interleaved`` rule to our separate banks, biases likewise. RoPE is YaRN with ``truncate=false``
(the blend's dimension range kept fractional). OpenAI's own files hold the experts in MXFP4 blocks and
scales: those are refused with the way to a dequantized copy.
"""

from __future__ import annotations

from typing import Any

from tessera.config import ModelConfig
from tessera.hf.families.common import Family, HFConversionError, Rule, copy, ends_rules, fail, ffn_hidden
from tessera.hf.families.llama import llama_from_hf, llama_layer_rules, llama_to_hf
from tessera.model.gpt_oss_experts import SWIGLU_ALPHA

_THETA = 150000.0  # transformers' GptOssConfig.default_theta, for a config that leaves it out
_TYPES = {"sliding_attention": "A", "full_attention": "G"}


def _layers_from_hf(hf: dict[str, Any], out: dict[str, Any]) -> None:
    """``layer_types`` (default: windowed, full, windowed, ...) and ``sliding_window`` -> a layer_pattern of A / G."""
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    bad = sorted(set(types) - set(_TYPES))
    if bad:
        fail("layer_types", bad[0], "gpt_oss", "supported: sliding_attention, full_attention")
    window = int(hf.get("sliding_window") or 0)
    pattern = "".join(_TYPES[t] for t in types) if window else ""
    out["attention"]["sliding_window"] = window if "A" in pattern else 0
    out["layer_pattern"] = "" if set(pattern) <= {"A"} else pattern


def _gpt_oss_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method", "?")
        raise HFConversionError(
            f"this gpt_oss checkpoint is quantized ({method}: experts as blocks and scales); tessera reads "
            "unquantized weights: load it with transformers' Mxfp4Config(dequantize=True) and save_pretrained it"
        )
    if float(hf.get("swiglu_alpha", SWIGLU_ALPHA)) != SWIGLU_ALPHA:
        fail("swiglu_alpha", hf["swiglu_alpha"], "gpt_oss", f"tessera's clamped SwiGLU uses {SWIGLU_ALPHA}")
    limit = float(hf.get("swiglu_limit", 7.0))
    if limit <= 0:
        fail("swiglu_limit", limit, "gpt_oss", "a positive clamp")
    out = llama_from_hf({"rope_theta": _THETA, **hf}, "gpt_oss")
    out["attention"].update(sinks=True)
    _layers_from_hf(hf, out)
    out["moe"] = {
        "experts": hf["num_local_experts"],
        "top_k": hf["num_experts_per_tok"],
        "router": "topk_softmax",
        "router_bias": True,
        "expert_biases": True,
        "swiglu_limit": limit,
        "ffn_hidden": hf["intermediate_size"],
        "aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.001)),
    }
    return out


def _gpt_oss_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    a, moe = cfg.attention, cfg.moe
    pattern = cfg.layer_pattern or "A"
    kinds = [pattern[i % len(pattern)] for i in range(cfg.n_layers)]
    types = ["sliding_attention" if a.sliding_window and k == "A" else "full_attention" for k in kinds]
    hf = llama_to_hf(cfg, "gpt_oss")
    for scaling in (hf["rope_parameters"], hf["rope_scaling"] or {}):
        if scaling.get("rope_type") == "yarn":  # YaRN's defaults, written as the published configs write them
            scaling.update(beta_fast=32.0, beta_slow=1.0)
    return {
        **hf,
        "intermediate_size": moe.ffn_hidden or ffn_hidden(cfg),
        "attention_bias": a.qkv_bias,
        "sliding_window": a.sliding_window or None,
        "layer_types": types,
        "num_local_experts": moe.experts,
        "num_experts_per_tok": moe.top_k,
        "router_aux_loss_coef": moe.aux_loss_coef,
        "swiglu_alpha": SWIGLU_ALPHA,
        "swiglu_limit": moe.swiglu_limit,
    }


def _expert_rules(ours: str, theirs: str) -> list[Rule]:
    """Our gate/up banks and biases <-> HF's interleaved ``gate_up_proj`` and its bias; down as it is."""
    return [
        Rule((f"{ours}.gate_proj", f"{ours}.up_proj"), (f"{theirs}.gate_up_proj",), "interleaved"),
        Rule((f"{ours}.gate_bias", f"{ours}.up_bias"), (f"{theirs}.gate_up_proj_bias",), "interleaved"),
        copy(f"{ours}.down_proj", f"{theirs}.down_proj"),
        copy(f"{ours}.down_bias", f"{theirs}.down_proj_bias"),
    ]


def _gpt_oss_rules(cfg: ModelConfig, family: str) -> list[Rule]:
    rules = ends_rules(cfg, "model.embed_tokens.weight", "model.norm.weight")
    for i in range(cfg.n_layers):
        ours, theirs, layer = llama_layer_rules(cfg, i)
        rules += layer + [
            copy(f"{ours}.attention.sinks.weight", f"{theirs}.self_attn.sinks"),
            copy(f"{ours}.moe.router.weight", f"{theirs}.mlp.router.weight"),
            copy(f"{ours}.moe.router.bias", f"{theirs}.mlp.router.bias"),
        ]
        rules += _expert_rules(f"{ours}.moe.experts", f"{theirs}.mlp.experts")
    return rules


FAMILIES = {
    "gpt_oss": Family(
        "gpt_oss", "GptOssForCausalLM", _gpt_oss_from_hf, _gpt_oss_to_hf, _gpt_oss_rules, ("rotary_emb.inv_freq",)
    ),
}
