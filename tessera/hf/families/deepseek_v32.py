"""DeepSeek-V3.2 (DeepseekV32ForCausalLM): DeepSeek-V3 with DeepSeek Sparse Attention (a lightning indexer per layer).

transformers' DeepSeek-V3.2 always rotates the latent attention's RoPE channels as interleaved pairs (it has no
``rope_interleave`` switch) and the indexer's as halves: the import de-interleaves the attention's RoPE rows, as
for interleaved DeepSeek-V3 checkpoints, and the export interleaves them back (:func:`_interleave`).
"""

from __future__ import annotations

from typing import Any

import torch

from tessera.config import ModelConfig
from tessera.hf.families.common import Family, HFConversionError, Rule, copy
from tessera.hf.families.deepseek import _deepseek_from_hf, _deepseek_prepare, _deepseek_rules, _deepseek_to_hf
from tessera.hf.families.deepseek import _deinterleave


def _v32_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    if not hf.get("q_lora_rank"):
        raise HFConversionError("deepseek_v32 needs q_lora_rank (the indexer reads the latent query)")
    if hf.get("mlp_layer_types") and hf["mlp_layer_types"] != _mlp_types(hf):
        raise HFConversionError(
            f"deepseek_v32 mlp_layer_types={hf['mlp_layer_types']!r} is not first_k_dense_replace dense layers then "
            "MoE layers, the only pattern tessera maps"
        )
    out = _deepseek_from_hf({**hf, "rope_interleave": True})
    out.pop("mtp_depth", None)  # transformers' V3.2 ignores the MTP layer (layers.61) on load
    out["dsa"] = {
        "topk": hf.get("index_topk", 2048),
        "index_heads": hf.get("index_n_heads", 64),
        "index_head_dim": hf.get("index_head_dim", 128),
    }
    return out


def _mlp_types(hf: dict[str, Any]) -> list[str]:
    dense = min(hf.get("first_k_dense_replace", 3), hf["num_hidden_layers"])
    return ["dense"] * dense + ["sparse"] * (hf["num_hidden_layers"] - dense)


def _v32_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    if cfg.mtp_depth:
        raise HFConversionError("model.mtp_depth cannot be expressed in deepseek_v32 (transformers drops MTP layers)")
    out = {k: v for k, v in _deepseek_to_hf(cfg).items() if k not in ("rope_interleave", "num_nextn_predict_layers")}
    dsa = cfg.dsa
    return {**out, "index_topk": dsa.topk, "index_n_heads": dsa.index_heads, "index_head_dim": dsa.index_head_dim}


def _indexer_rules(cfg: ModelConfig) -> list[Rule]:
    rules = []
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i}.attention.indexer", f"model.layers.{i}.self_attn.indexer"
        rules += [copy(f"{ours}.{n}.weight", f"{theirs}.{n}.weight") for n in ("wq_b", "wk", "k_norm", "weights_proj")]
        rules += [copy(f"{ours}.k_norm.bias", f"{theirs}.k_norm.bias")]
    return rules


def _v32_rules(cfg: ModelConfig, family: str) -> list[Rule]:
    return _deepseek_rules(cfg, family) + _indexer_rules(cfg)


def _v32_prepare(hf: dict[str, Any], cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    _deepseek_prepare({**hf, "rope_interleave": True}, cfg, tensors)


def _interleave(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    """The inverse of the import's de-interleaving, in place on exported HF tensors."""
    mla = cfg.mla
    qk = mla.nope_head_dim + mla.rope_head_dim
    for name in list(tensors):
        if name.endswith("q_b_proj.weight"):
            order = _deinterleave(tensors[name].shape[0], qk, mla.nope_head_dim)
        elif ".kv_a_proj_with_mqa." in name:
            rows = tensors[name].shape[0]
            order = _deinterleave(rows, rows, mla.kv_rank)
        else:
            continue
        tensors[name] = tensors[name][torch.argsort(order)].contiguous()


FAMILIES = {
    "deepseek_v32": Family(
        "deepseek_v32",
        "DeepseekV32ForCausalLM",
        _v32_from_hf,
        _v32_to_hf,
        _v32_rules,
        ("rotary_emb.inv_freq", "shared_head.head.weight", "embed_tokens.weight", "model.layers.61."),
        _v32_prepare,
        _interleave,
    ),
}
