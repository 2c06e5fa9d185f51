"""Gemma 3 (text, HF ``Gemma3ForCausalLM``, model_type ``gemma3_text``): 5 local to 1 global layers with
their own RoPE bases, sandwich norms of gain 1 + w, per-head QK-norm, sqrt(dim)-scaled embeddings, GeGLU."""

from __future__ import annotations

from typing import Any

from tessera.config import ModelConfig
from tessera.hf.families.common import Family, Rule, copy, ends_rules, fail, ffn_hidden, get
from tessera.hf.families.layered import pattern_from_types, position_from_hf, position_to_hf, types_of
from tessera.hf.families.llama import attention_rules, dense_ffn_rules, llama_from_hf

FAMILY = "gemma3_text"


def _layer_types(hf: dict[str, Any]) -> list[str]:
    n, period = hf["num_hidden_layers"], int(hf.get("sliding_window_pattern") or 6)
    return hf.get("layer_types") or ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(n)]


def _refuse(hf: dict[str, Any]) -> None:
    if hf.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        fail("hidden_activation", hf["hidden_activation"], FAMILY)
    if hf.get("use_bidirectional_attention"):
        fail("use_bidirectional_attention", True, FAMILY, "tessera's Gemma 3 is the causal LM")
    if hf.get("attn_logit_softcapping") is not None:  # HF's Gemma 3 attention never applies it
        fail("attn_logit_softcapping", hf["attn_logit_softcapping"], FAMILY, "HF's Gemma 3 ignores it")
    if hf.get("attention_bias"):
        fail("attention_bias", True, FAMILY)


def gemma3_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig keys of an HF Gemma 3 text config."""
    _refuse(hf)
    dim, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = int(get(hf, "head_dim", default=dim // n_heads))
    pattern = pattern_from_types(_layer_types(hf), FAMILY)
    scalar = float(hf.get("query_pre_attn_scalar") or head_dim)
    plain = {**hf, "hidden_act": "gelu_pytorch_tanh", "rope_parameters": None, "rope_scaling": None}
    out = llama_from_hf(plain, FAMILY)  # the shapes; norms, attention and positions are Gemma's
    out.update(
        norm="zero_centered_rmsnorm",
        norm_position="sandwich",
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        embed_scale=True,
        logit_softcap=float(hf.get("final_logit_softcapping") or 0.0),
        layer_pattern=pattern,
        position=position_from_hf(hf, pattern, FAMILY, hf.get("rope_local_base_freq")),
    )
    out["attention"] = {
        "qk_norm": True,
        "scale": 0.0 if scalar == head_dim else scalar**-0.5,
        "sliding_window": int(hf.get("sliding_window") or 0) if pattern else 0,
    }
    return out


def gemma3_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The HF Gemma 3 text config of a tessera config (exactness is checked by the caller)."""
    head_dim = cfg.head_dim or cfg.dim // cfg.n_heads
    scale = cfg.attention.scale
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads or cfg.n_heads,
        "head_dim": head_dim,
        "intermediate_size": ffn_hidden(cfg),
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings,
        "query_pre_attn_scalar": head_dim if not scale else round(scale**-2),  # an int in HF (the round trip checks)
        "sliding_window": cfg.attention.sliding_window or None,
        "layer_types": types_of(cfg),
        "final_logit_softcapping": cfg.logit_softcap or None,
        "attn_logit_softcapping": None,
        "attention_bias": False,
        **position_to_hf(cfg),
    }


def sandwich_rules(ours: str, theirs: str) -> list[Rule]:
    """Pre- and post-sublayer norms of a sandwich-norm block (Gemma 2/3 names)."""
    pairs = (
        ("attention_norm", "input_layernorm"),
        ("attention_post_norm", "post_attention_layernorm"),
        ("ffn_norm", "pre_feedforward_layernorm"),
        ("ffn_post_norm", "post_feedforward_layernorm"),
    )
    return [copy(f"{ours}.{mine}.weight", f"{theirs}.{hf}.weight") for mine, hf in pairs]


def gemma3_rules(cfg: ModelConfig, family: str) -> list[Rule]:
    """Weight names of Gemma 3's text model."""
    rules = ends_rules(cfg, "model.embed_tokens.weight", "model.norm.weight")
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i}", f"model.layers.{i}"
        rules += sandwich_rules(ours, theirs)
        rules += attention_rules(cfg, ours, theirs)
        rules += dense_ffn_rules(cfg, f"{ours}.feed_forward", f"{theirs}.mlp")
    return rules


FAMILIES = {
    FAMILY: Family(FAMILY, "Gemma3ForCausalLM", gemma3_from_hf, gemma3_to_hf, gemma3_rules, ("rotary_emb",)),
}
