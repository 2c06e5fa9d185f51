"""Kimi Linear (KimiLinearForCausalLM): Kimi Delta Attention layers ("K") interleaved with NoPE latent attention
("A", DeepSeek's MLA without positions), then DeepSeek-V3-style MoE (sigmoid router, aux-free bias, shared expert)
after ``first_k_dense_replace`` dense layers.

Weight names are the published checkpoints' (what transformers writes back): KDA's q/k/v_conv1d, f_a/f_b_proj,
dt_bias and A_log under ``self_attn``; dense FFNs under ``mlp``, MoE layers under ``block_sparse_moe`` with
per-expert w1/w3/w2. transformers saves its dense layers under ``block_sparse_moe`` too; import renames them.
"""

from __future__ import annotations

from typing import Any

import torch

from tessera.config import ModelConfig
from tessera.hf.families.common import ACT_IN, ACT_OUT, Family, HFConversionError, Rule, copy, ends_rules, fail, get
from tessera.hf.families.deepseek import _mla_from_hf, _mla_rules, mla_to_hf
from tessera.hf.families.common import ffn_hidden
from tessera.hf.families.llama import dense_ffn_rules, expert_rules
from tessera.hf.families.mamba import compress_pattern
from tessera.model.block import layer_kind
from tessera.model.moe import is_moe_layer

FAMILY = "kimi_linear"
_KINDS = {"linear_attention": "K", "full_attention": "A"}
_KDA_KEYS = {"heads": ("linear_num_heads", "num_heads"), "head_dim": ("linear_head_dim", "head_dim")}
_KDA_KEYS["conv"] = ("linear_conv_kernel_dim", "short_conv_kernel_size")
_KDA_NAMES = ("q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj", "g_a_proj", "g_b_proj", "o_proj")
_KDA_NAMES += ("q_conv1d", "k_conv1d", "v_conv1d", "o_norm")
_COPIED = {"vocab_size": "vocab_size", "dim": "hidden_size", "n_heads": "num_attention_heads"}
_COPIED["ffn_hidden"] = "intermediate_size"


def _layer_types(hf: dict[str, Any]) -> list[str]:
    """HF's layer_types, else the checkpoint's 1-indexed linear_attn_config lists, else HF's default (every 4th
    layer after the first is full attention)."""
    n, linear = hf["num_hidden_layers"], hf.get("linear_attn_config") or {}
    if hf.get("layer_types"):
        return list(hf["layer_types"])
    if "full_attn_layers" in linear:
        full = {int(i) - 1 for i in linear["full_attn_layers"]}
        return ["full_attention" if i in full else "linear_attention" for i in range(n)]
    return ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]


def _kda_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    linear = hf.get("linear_attn_config") or {}
    defaults = {"heads": 32, "head_dim": 128, "conv": 4}
    kda = {ours: int(linear.get(nested, hf.get(top, defaults[ours]))) for ours, (top, nested) in _KDA_KEYS.items()}
    bad = next((k for k, v in kda.items() if v <= 0), None)
    if bad:
        fail(_KDA_KEYS[bad][0], kda[bad], FAMILY, "the Kimi Delta Attention state dims must be positive")
    return kda


def _first_dense(hf: dict[str, Any]) -> int:
    types = hf.get("mlp_layer_types")
    if not types:
        return int(hf.get("first_k_dense_replace", 1))
    first = types.index("sparse") if "sparse" in types else len(types)
    if any(t != "sparse" for t in types[first:]):
        fail("mlp_layer_types", types, FAMILY, "tessera needs the dense layers first, then only sparse ones")
    return first


def _moe_from_hf(hf: dict[str, Any], first: int) -> dict[str, Any]:
    if hf.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        fail("moe_router_activation_func", hf["moe_router_activation_func"], FAMILY)
    hidden, shared = hf["moe_intermediate_size"], int(get(hf, "num_shared_experts", "n_shared_experts", default=1))
    return {
        "experts": int(get(hf, "num_experts", "num_local_experts", default=256)),
        "top_k": int(get(hf, "num_experts_per_token", "num_experts_per_tok", default=8)),
        "first_dense": first,
        "router": "sigmoid",
        "norm_topk": bool(get(hf, "moe_renormalize", "norm_topk_prob", default=True)),
        "route_scale": float(hf.get("routed_scaling_factor", 2.446)),
        "groups": int(get(hf, "num_expert_group", "n_group", default=1)),
        "topk_groups": int(hf.get("topk_group") or 1),
        "expert_bias": True,
        "bias_update_rate": 0.001,
        "ffn_hidden": hidden,
        "shared_experts": shared,
        "shared_ffn_hidden": hidden * shared,
    }


def _from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        fail("hidden_act", act, FAMILY, "the KDA convolution and the FFNs use silu")
    n_heads = hf["num_attention_heads"]
    if get(hf, "num_key_value_heads", default=n_heads) != n_heads:
        fail("num_key_value_heads", hf["num_key_value_heads"], FAMILY, "latent attention expands every head")
    if hf.get("mla_use_nope", True) is not True:
        fail("mla_use_nope", hf["mla_use_nope"], FAMILY, "Kimi Linear's latent attention has no positions")
    types = _layer_types(hf)
    bad = sorted(set(types) - set(_KINDS))
    if bad:
        fail("layer_types", bad[0], FAMILY, "supported: linear_attention, full_attention")
    bias, n_layers, first = bool(hf.get("attention_bias", False)), len(types), _first_dense(hf)
    out: dict[str, Any] = {ours: hf[theirs] for ours, theirs in _COPIED.items()}
    out.update(n_layers=n_layers, activation=ACT_IN[act], norm_eps=float(hf.get("rms_norm_eps", 1e-5)))
    out["max_seq_len"] = int(get(hf, "model_max_length", "max_position_embeddings", default=1048576))
    out["tie_embeddings"] = bool(hf.get("tie_word_embeddings", False))
    out["attention"], out["position"] = {"qkv_bias": bias, "o_bias": bias}, {"kind": "none"}
    out["mla"] = {**_mla_from_hf({**hf, "rope_parameters": None, "rope_scaling": None}), "norm_eps": 1e-6}
    out["layer_pattern"] = compress_pattern("".join(_KINDS[t] for t in types))
    out["kda"] = _kda_from_hf(hf)
    if first < n_layers:
        out["moe"] = _moe_from_hf(hf, first)
    return out


def _moe_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    moe = cfg.moe
    if not moe.experts:
        return {"mlp_layer_types": ["dense"] * cfg.n_layers, "first_k_dense_replace": cfg.n_layers}
    if moe.router != "sigmoid" or not moe.expert_bias or moe.every != 1 or moe.shared_experts < 1:
        raise HFConversionError(
            "kimi_linear MoE layers need model.moe.router='sigmoid', expert_bias=true, every=1 and shared_experts >= 1"
        )
    return {
        "mlp_layer_types": ["sparse" if is_moe_layer(cfg, i) else "dense" for i in range(cfg.n_layers)],
        "first_k_dense_replace": moe.first_dense,
        "num_experts": moe.experts,
        "num_experts_per_token": moe.top_k,
        "moe_intermediate_size": moe.ffn_hidden or ffn_hidden(cfg),
        "num_shared_experts": moe.shared_experts,
        "moe_renormalize": moe.norm_topk,
        "routed_scaling_factor": moe.route_scale,
        "num_expert_group": moe.groups,
        "topk_group": moe.topk_groups,
        "moe_router_activation_func": "sigmoid",
    }


def _to_hf(cfg: ModelConfig) -> dict[str, Any]:
    mla, kda = cfg.mla, cfg.kda
    if cfg.position.kind != "none" or mla.norm_eps != 1e-6 or cfg.activation != "swiglu":
        raise HFConversionError(
            "kimi_linear needs model.position.kind='none', model.mla.norm_eps=1e-6 and model.activation='swiglu'"
        )
    types = ["linear_attention" if layer_kind(cfg, i) == "K" else "full_attention" for i in range(cfg.n_layers)]
    return {
        **{theirs: getattr(cfg, ours) for ours, theirs in _COPIED.items() if ours != "ffn_hidden"},
        "intermediate_size": ffn_hidden(cfg),
        "num_hidden_layers": cfg.n_layers,
        "num_key_value_heads": cfg.n_heads,
        "hidden_act": ACT_OUT[cfg.activation],
        "rms_norm_eps": cfg.norm_eps,
        "model_max_length": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings,
        **mla_to_hf(cfg),
        "mla_use_nope": True,
        # KimiLinearConfig's defaults are the released vocabulary's; the export writes the tokenizer's ids
        **{f"{name}_token_id": None for name in ("pad", "bos", "eos")},
        "layer_types": types,
        "linear_num_heads": kda.heads,
        "linear_head_dim": kda.head_dim,
        "linear_conv_kernel_dim": kda.conv,
        "linear_attn_config": {  # the published checkpoints' form (1-indexed layers)
            "full_attn_layers": [i + 1 for i, t in enumerate(types) if t == "full_attention"],
            "kda_layers": [i + 1 for i, t in enumerate(types) if t == "linear_attention"],
            "num_heads": kda.heads,
            "head_dim": kda.head_dim,
            "short_conv_kernel_size": kda.conv,
        },
        **_moe_to_hf(cfg),
    }


def _layer_rules(cfg: ModelConfig, i: int) -> list[Rule]:
    ours, theirs = f"layers.{i}", f"model.layers.{i}"
    kda = layer_kind(cfg, i) == "K"
    rules = [
        copy(f"{ours}.{'kda' if kda else 'attention'}_norm.weight", f"{theirs}.input_layernorm.weight"),
        copy(f"{ours}.ffn_norm.weight", f"{theirs}.post_attention_layernorm.weight"),
    ]
    if kda:
        rules += [copy(f"{ours}.kda.{n}.weight", f"{theirs}.self_attn.{n}.weight") for n in _KDA_NAMES]
        rules += [copy(f"{ours}.kda.{n}", f"{theirs}.self_attn.{n}") for n in ("dt_bias", "A_log")]
    else:
        rules += _mla_rules(cfg, f"{ours}.attention", f"{theirs}.self_attn")
    if not is_moe_layer(cfg, i):
        return rules + dense_ffn_rules(cfg, f"{ours}.feed_forward", f"{theirs}.mlp")
    moe = f"{theirs}.block_sparse_moe"
    rules += [
        copy(f"{ours}.moe.router.weight", f"{moe}.gate.weight"),
        copy(f"{ours}.moe.expert_bias", f"{moe}.gate.e_score_correction_bias"),
    ]
    rules += expert_rules(f"{ours}.moe", moe, cfg.moe.experts, ("w1", "w3", "w2"))
    return rules + dense_ffn_rules(cfg, f"{ours}.moe.shared", f"{moe}.shared_experts", bias=False)


def _rules(cfg: ModelConfig, family: str) -> list[Rule]:
    rules = ends_rules(cfg, "model.embed_tokens.weight", "model.norm.weight")
    for i in range(cfg.n_layers):
        rules += _layer_rules(cfg, i)
    return rules


def _prepare(hf: dict[str, Any], cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    """transformers writes the dense FFNs under ``block_sparse_moe`` (its reverse rename); the checkpoints under
    ``mlp``."""
    for name in list(tensors):
        head, sep, tail = name.partition(".block_sparse_moe.")
        if sep and tail.split(".")[0] in ("gate_proj", "up_proj", "down_proj"):
            tensors[f"{head}.mlp.{tail}"] = tensors.pop(name)


FAMILIES = {FAMILY: Family(FAMILY, "KimiLinearForCausalLM", _from_hf, _to_hf, _rules, (), _prepare)}
