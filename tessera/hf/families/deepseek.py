"""DeepSeek-V3 (DeepseekV3ForCausalLM): multi-head latent attention, then dense FFNs or routed experts."""

from __future__ import annotations

from typing import Any

import torch

from tessera.config import ModelConfig
from tessera.hf.families.common import (
    Family,
    HFConversionError,
    Rule,
    copy,
    decoder_to_hf,
    ends_rules,
    fail,
    ffn_hidden,
    get,
    linear,
    rope_from_hf,
    rope_params,
    rope_to_hf,
    decoder_from_hf,
)
from tessera.hf.families.llama import dense_ffn_rules, expert_rules, layer_norm_rules
from tessera.model.moe import is_moe_layer


def _mla_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    mla = {
        "kv_rank": hf["kv_lora_rank"],
        "q_rank": hf.get("q_lora_rank") or 0,
        "rope_head_dim": hf["qk_rope_head_dim"],
        "nope_head_dim": hf["qk_nope_head_dim"],
        "v_head_dim": hf["v_head_dim"],
    }
    params = rope_params(hf)
    if params["rope_type"] != "default" and params.get("mscale_all_dim"):
        mla["mscale"] = float(params["mscale_all_dim"])
    return mla


def _deepseek_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    out = decoder_from_hf(hf, "deepseek_v3")
    n_heads = hf["num_attention_heads"]
    if get(hf, "num_key_value_heads", default=n_heads) != n_heads:
        fail("num_key_value_heads", hf["num_key_value_heads"], "deepseek_v3", "latent attention expands every head")
    n_layers = hf["num_hidden_layers"]
    bias = bool(hf.get("attention_bias", False))
    out = {
        **out,
        "attention": {"qkv_bias": bias, "o_bias": bias},
        "position": rope_from_hf(hf, "deepseek_v3"),
        "mla": _mla_from_hf(hf),
    }
    if hf.get("first_k_dense_replace", 3) < n_layers:
        out["moe"] = _moe_from_hf(hf)
    if hf.get("num_nextn_predict_layers"):  # kept only where the checkpoint has the weights (see _deepseek_prepare)
        out["mtp_depth"] = hf["num_nextn_predict_layers"]
    return out


def _moe_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3 routing: sigmoid scores, group-limited top-k, aux-free bias, scaled weights, shared experts.
    The training-only keys follow the paper (sequence-wise aux loss 1e-4, bias update speed 1e-3)."""
    if hf.get("topk_method", "noaux_tc") != "noaux_tc" or hf.get("scoring_func", "sigmoid") != "sigmoid":
        fail("topk_method/scoring_func", (hf.get("topk_method"), hf.get("scoring_func")), "deepseek_v3")
    hidden, shared = hf["moe_intermediate_size"], int(hf.get("n_shared_experts") or 0)
    return {
        "experts": get(hf, "n_routed_experts", "num_local_experts"),
        "top_k": hf["num_experts_per_tok"],
        "first_dense": hf.get("first_k_dense_replace", 3),
        "router": "sigmoid",
        "norm_topk": bool(hf.get("norm_topk_prob", True)),
        "route_scale": float(hf.get("routed_scaling_factor", 1.0)),
        "groups": hf.get("n_group") or 1,
        "topk_groups": hf.get("topk_group") or 1,
        "expert_bias": True,
        "bias_update_rate": 0.001,
        "aux_loss_scope": "sequence",
        "aux_loss_coef": 0.0001,
        "ffn_hidden": hidden,
        "shared_experts": shared,
        "shared_ffn_hidden": hidden * shared,
    }


def _moe_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    moe = cfg.moe
    if not moe.experts:
        return {"first_k_dense_replace": cfg.n_layers}
    if moe.router != "sigmoid":
        raise HFConversionError(f"model.moe.router={moe.router!r} cannot be expressed in deepseek_v3; use sigmoid")
    return {
        "first_k_dense_replace": moe.first_dense,
        "n_routed_experts": moe.experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.ffn_hidden or ffn_hidden(cfg),
        "n_shared_experts": moe.shared_experts,
        "norm_topk_prob": moe.norm_topk,
        "routed_scaling_factor": moe.route_scale,
        "n_group": moe.groups,
        "topk_group": moe.topk_groups,
    }


def mla_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The latent-attention keys of an HF config (DeepSeek-V3, Kimi Linear)."""
    mla = cfg.mla
    return {
        "attention_bias": cfg.attention.qkv_bias,
        "kv_lora_rank": mla.kv_rank,
        "q_lora_rank": mla.q_rank or None,
        "qk_rope_head_dim": mla.rope_head_dim,
        "qk_nope_head_dim": mla.nope_head_dim,
        "v_head_dim": mla.v_head_dim,
    }


def _deepseek_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    mla, rope = cfg.mla, rope_to_hf(cfg)
    if mla.mscale and rope["rope_scaling"]:
        for params in (rope["rope_scaling"], rope["rope_parameters"]):
            params["mscale_all_dim"] = mla.mscale
    return {
        **decoder_to_hf(cfg),
        "num_key_value_heads": cfg.n_heads,  # latent attention: every head has its keys and values
        **mla_to_hf(cfg),
        "rope_interleave": False,  # tessera rotates halves; interleaved checkpoints are de-interleaved on import
        "num_nextn_predict_layers": cfg.mtp_depth,  # DeepSeek-V3's MTP modules, stored as layers n_layers + k
        **_moe_to_hf(cfg),
        **rope,
    }


def _mla_rules(cfg: ModelConfig, ours: str, theirs: str) -> list[Rule]:
    bias = cfg.attention.qkv_bias
    rules = linear(f"{ours}.kv_a_proj_with_mqa", f"{theirs}.kv_a_proj_with_mqa", bias)
    rules += [copy(f"{ours}.kv_a_layernorm.weight", f"{theirs}.kv_a_layernorm.weight")]
    rules += [copy(f"{ours}.kv_b_proj.weight", f"{theirs}.kv_b_proj.weight")]
    rules += linear(f"{ours}.o_proj", f"{theirs}.o_proj", cfg.bias or cfg.attention.o_bias)
    if cfg.mla.q_rank:
        rules += linear(f"{ours}.q_a_proj", f"{theirs}.q_a_proj", bias)
        rules += [copy(f"{ours}.q_a_layernorm.weight", f"{theirs}.q_a_layernorm.weight")]
        rules += [copy(f"{ours}.q_b_proj.weight", f"{theirs}.q_b_proj.weight")]
    else:
        rules += [copy(f"{ours}.q_proj.weight", f"{theirs}.q_proj.weight")]
    return rules


def _layer_rules(cfg: ModelConfig, ours: str, theirs: str, index: int) -> list[Rule]:
    """One block's rules (``index`` says whether it is a MoE layer)."""
    rules = layer_norm_rules(ours, theirs) + _mla_rules(cfg, f"{ours}.attention", f"{theirs}.self_attn")
    if not is_moe_layer(cfg, index):
        return rules + dense_ffn_rules(cfg, f"{ours}.feed_forward", f"{theirs}.mlp")
    rules += [
        copy(f"{ours}.moe.router.weight", f"{theirs}.mlp.gate.weight"),
        copy(f"{ours}.moe.expert_bias", f"{theirs}.mlp.gate.e_score_correction_bias"),
    ]
    rules += expert_rules(f"{ours}.moe", f"{theirs}.mlp", cfg.moe.experts, ("gate_proj", "up_proj", "down_proj"))
    if cfg.moe.shared_experts:
        rules += dense_ffn_rules(cfg, f"{ours}.moe.shared", f"{theirs}.mlp.shared_experts", bias=False)
    return rules


def _mtp_rules(cfg: ModelConfig) -> list[Rule]:
    """DeepSeek-V3's MTP module k sits at model.layers.{n_layers + k}: its block's weights plus enorm, hnorm,
    eh_proj and shared_head.norm (the checkpoint's copies of the embedding and head are not written)."""
    rules = []
    for k in range(cfg.mtp_depth):
        ours, theirs, index = f"mtp.{k}", f"model.layers.{cfg.n_layers + k}", cfg.n_layers + k
        rules += [copy(f"{ours}.{n}.weight", f"{theirs}.{n}.weight") for n in ("enorm", "hnorm", "eh_proj")]
        rules += [copy(f"{ours}.norm.weight", f"{theirs}.shared_head.norm.weight")]
        rules += _layer_rules(cfg, f"{ours}.block", theirs, index)
    return rules


def _deepseek_rules(cfg: ModelConfig, family: str) -> list[Rule]:
    rules = ends_rules(cfg, "model.embed_tokens.weight", "model.norm.weight")
    for i in range(cfg.n_layers):
        rules += _layer_rules(cfg, f"layers.{i}", f"model.layers.{i}", i)
    return rules + _mtp_rules(cfg)


def _deinterleave(rows: int, head: int, start: int) -> torch.Tensor:
    """Row order that moves each ``head``-row block's RoPE rows ``start..`` from pairs (x0, x1), (x2, x3), ...
    to halves (x0, x2, ...), (x1, x3, ...)."""
    order = torch.arange(rows)
    rope = head - start
    for h in range(0, rows, head):
        block = order[h + start : h + head].clone()
        order[h + start : h + start + rope // 2] = block[0::2]
        order[h + start + rope // 2 : h + head] = block[1::2]
    return order


def _deepseek_prepare(hf: dict[str, Any], cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    """De-interleave the RoPE channels of interleaved checkpoints (``rope_interleave``, DeepSeek's default) in place:
    rotating pairs equals rotating halves of the permuted channels, in queries and keys alike."""
    # MTP modules: as many as the checkpoint has weights for (transformers' own saves drop them).
    cfg.mtp_depth = sum(f"model.layers.{cfg.n_layers + k}.eh_proj.weight" in tensors for k in range(cfg.mtp_depth))
    if not hf.get("rope_interleave", True):
        return
    mla = cfg.mla
    qk = mla.nope_head_dim + mla.rope_head_dim
    for name in list(tensors):
        if name.endswith(("q_proj.weight", "q_b_proj.weight")):
            tensors[name] = tensors[name][_deinterleave(tensors[name].shape[0], qk, mla.nope_head_dim)]
        elif ".kv_a_proj_with_mqa." in name:
            rows = tensors[name].shape[0]
            tensors[name] = tensors[name][_deinterleave(rows, rows, mla.kv_rank)]


FAMILIES = {
    "deepseek_v3": Family(
        "deepseek_v3",
        "DeepseekV3ForCausalLM",
        _deepseek_from_hf,
        _deepseek_to_hf,
        _deepseek_rules,
        ("rotary_emb.inv_freq", "shared_head.head.weight", "embed_tokens.weight"),
        _deepseek_prepare,
    ),
}
