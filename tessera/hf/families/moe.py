"""Llama-like MoE families: Qwen2-MoE (shared expert behind a sigmoid gate), Qwen3-MoE (per-head QK-norm) and
OLMoE (QK-norm over all heads' channels). Mixtral is in llama.py, DeepSeek-V3 in deepseek.py."""

from __future__ import annotations

from typing import Any

from tessera.config import ModelConfig
from tessera.hf.families.common import Family, HFConversionError, Rule, copy, ends_rules, fail, ffn_hidden, get
from tessera.hf.families.llama import (
    dense_ffn_rules,
    expert_rules,
    llama_from_hf,
    llama_layer_rules,
    llama_to_hf,
    qwen2_layers_from_hf,
    qwen2_layers_to_hf,
)
from tessera.model.moe import is_moe_layer

_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


def first_dense_from_hf(hf: dict[str, Any], family: str) -> int:
    """``mlp_only_layers`` as tessera's ``moe.first_dense`` (only a leading run of dense layers maps)."""
    dense = sorted(hf.get("mlp_only_layers") or [])
    if dense != list(range(len(dense))):
        fail("mlp_only_layers", dense, family, "only the first layers can be dense (model.moe.first_dense)")
    return len(dense)


def _router_from_hf(hf: dict[str, Any]) -> str:
    """Softmax over all experts, then top-k: renormalized over the k (= softmax of the top-k logits) or not."""
    return "topk_softmax" if hf.get("norm_topk_prob") else "softmax_topk"


def _moe_from_hf(hf: dict[str, Any], family: str, expert_hidden: int) -> dict[str, Any]:
    moe: dict[str, Any] = {
        "experts": get(hf, "num_experts", "num_local_experts"),  # transformers 5 writes the latter
        "top_k": hf["num_experts_per_tok"],
        "every": hf.get("decoder_sparse_step", 1),
        "router": _router_from_hf(hf),
        "ffn_hidden": expert_hidden,
        "aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.001)),
    }
    first = first_dense_from_hf(hf, family)
    if first:
        moe["first_dense"] = first
    return moe


def _moe_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    moe = cfg.moe
    if moe.router not in ("topk_softmax", "softmax_topk"):
        raise HFConversionError(f"model.moe.router={moe.router!r} cannot be expressed; use a softmax router")
    first = getattr(moe, "first_dense", 0)
    return {
        "num_experts": moe.experts,
        "num_experts_per_tok": moe.top_k,
        "decoder_sparse_step": moe.every,
        "norm_topk_prob": moe.router == "topk_softmax",
        "moe_intermediate_size": moe.ffn_hidden or ffn_hidden(cfg),
        "router_aux_loss_coef": moe.aux_loss_coef,
        "mlp_only_layers": list(range(first)),
    }


def _qwen2_moe_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    out = llama_from_hf(hf, "qwen2_moe")
    out["attention"].update(qkv_bias=bool(hf.get("qkv_bias", True)), o_bias=False)
    out["moe"] = _moe_from_hf(hf, "qwen2_moe", hf["moe_intermediate_size"])
    shared = int(hf.get("shared_expert_intermediate_size", 5632))
    if not shared:
        fail("shared_expert_intermediate_size", 0, "qwen2_moe")
    out["moe"].update(shared_experts=1, shared_ffn_hidden=shared, shared_gate=True)
    return qwen2_layers_from_hf(hf, out, "qwen2_moe")


def _qwen2_moe_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    moe = cfg.moe
    if moe.shared_experts != 1 or not getattr(moe, "shared_gate", False):
        raise HFConversionError(
            "qwen2_moe always has one gated shared expert: set model.moe.shared_experts=1 and "
            "model.moe.shared_gate=true"
        )
    expert = moe.ffn_hidden or ffn_hidden(cfg)
    return {
        **llama_to_hf(cfg, "qwen2_moe"),
        **qwen2_layers_to_hf(cfg),
        **_moe_to_hf(cfg),
        "qkv_bias": cfg.attention.qkv_bias,
        "shared_expert_intermediate_size": getattr(moe, "shared_ffn_hidden", 0) or expert,
    }


def _qwen3_moe_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    out = llama_from_hf(hf, "qwen3_moe")
    out["attention"].update(qk_norm=True)
    if hf.get("use_sliding_window"):  # one window for every layer
        out["attention"]["sliding_window"] = int(hf.get("sliding_window") or 0)
    out["moe"] = _moe_from_hf(hf, "qwen3_moe", hf["moe_intermediate_size"])
    return out


def _qwen3_moe_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    window = cfg.attention.sliding_window
    return {
        **llama_to_hf(cfg, "qwen3_moe"),
        **_moe_to_hf(cfg),
        "attention_bias": cfg.attention.qkv_bias,
        "use_sliding_window": bool(window),
        "sliding_window": window or None,
    }


def _olmoe_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("clip_qkv") is not None:
        fail("clip_qkv", hf["clip_qkv"], "olmoe")
    out = llama_from_hf(hf, "olmoe")
    out["attention"].update(qk_norm=True, qk_norm_scope="all")
    out["moe"] = _moe_from_hf(hf, "olmoe", hf["intermediate_size"])
    return out


def _olmoe_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    moe = _moe_to_hf(cfg)
    if moe["decoder_sparse_step"] != 1 or moe["mlp_only_layers"]:
        raise HFConversionError("model.moe.every and model.moe.first_dense cannot be expressed in olmoe (all MoE)")
    return {
        **llama_to_hf(cfg, "olmoe"),
        "intermediate_size": moe["moe_intermediate_size"],
        "num_experts": moe["num_experts"],
        "num_experts_per_tok": moe["num_experts_per_tok"],
        "norm_topk_prob": moe["norm_topk_prob"],
        "router_aux_loss_coef": moe["router_aux_loss_coef"],
        "attention_bias": cfg.attention.qkv_bias,
        "clip_qkv": None,
    }


def _moe_rules(cfg: ModelConfig, family: str) -> list[Rule]:
    rules = ends_rules(cfg, "model.embed_tokens.weight", "model.norm.weight")
    for i in range(cfg.n_layers):
        ours, theirs, layer = llama_layer_rules(cfg, i)
        rules += layer
        if not is_moe_layer(cfg, i):
            rules += dense_ffn_rules(cfg, f"{ours}.feed_forward", f"{theirs}.mlp")
            continue
        rules.append(copy(f"{ours}.moe.router.weight", f"{theirs}.mlp.gate.weight"))
        rules += expert_rules(f"{ours}.moe", f"{theirs}.mlp", cfg.moe.experts, _EXPERT_NAMES)
        if cfg.moe.shared_experts:
            rules += dense_ffn_rules(cfg, f"{ours}.moe.shared", f"{theirs}.mlp.shared_expert", bias=False)
            rules.append(copy(f"{ours}.moe.shared_gate.weight", f"{theirs}.mlp.shared_expert_gate.weight"))
    return rules


_ROPE_BUFFERS = ("rotary_emb.inv_freq",)

FAMILIES = {
    "qwen2_moe": Family(
        "qwen2_moe", "Qwen2MoeForCausalLM", _qwen2_moe_from_hf, _qwen2_moe_to_hf, _moe_rules, _ROPE_BUFFERS
    ),
    "qwen3_moe": Family(
        "qwen3_moe", "Qwen3MoeForCausalLM", _qwen3_moe_from_hf, _qwen3_moe_to_hf, _moe_rules, _ROPE_BUFFERS
    ),
    "olmoe": Family("olmoe", "OlmoeForCausalLM", _olmoe_from_hf, _olmoe_to_hf, _moe_rules, _ROPE_BUFFERS),
}
