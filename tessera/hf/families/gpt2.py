"""GPT-2."""

from __future__ import annotations

from typing import Any

from tessera.config import ModelConfig
from tessera.hf.families.common import Family, Rule, copy, fail, ffn_hidden, norm, sizes_from_hf, sizes_to_hf

_GPT2_ACT = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}

_SIZES = {
    "vocab_size": "vocab_size",
    "dim": "n_embd",
    "n_layers": "n_layer",
    "n_heads": "n_head",
    "max_seq_len": "n_positions",
}


def _gpt2_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("add_cross_attention"):
        fail("add_cross_attention", True, "gpt2")
    act = hf.get("activation_function", "gelu_new")
    if act not in _GPT2_ACT:
        fail("activation_function", act, "gpt2")
    dim = hf["n_embd"]
    return dict(
        sizes_from_hf(hf, _SIZES),
        ffn_hidden=hf.get("n_inner") or 4 * dim,
        activation=_GPT2_ACT[act],
        norm="layernorm",
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        position="learned",
        bias=True,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        attention={
            "qkv_bias": True,
            "scale": 0.0 if hf.get("scale_attn_weights", True) else 1.0,
            "scale_by_layer": bool(hf.get("scale_attn_by_inverse_layer_idx", False)),
        },
    )


def _gpt2_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        **sizes_to_hf(cfg, _SIZES),
        "n_inner": ffn_hidden(cfg),
        "activation_function": {"gelu_tanh": "gelu_new"}.get(cfg.activation, cfg.activation),
        "layer_norm_epsilon": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "scale_attn_weights": cfg.attention.scale == 0.0,
        "scale_attn_by_inverse_layer_idx": cfg.attention.scale_by_layer,
    }


def _gpt2_rules(cfg: ModelConfig, family: str) -> list[Rule]:
    rules = [
        copy("tok_embeddings.weight", "transformer.wte.weight"),
        copy("pos_embeddings.weight", "transformer.wpe.weight"),
    ]
    rules += norm("norm", "transformer.ln_f", cfg)
    if not cfg.tie_embeddings:
        rules.append(copy("output.weight", "lm_head.weight"))
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i}", f"transformer.h.{i}"
        rules += norm(f"{ours}.attention_norm", f"{theirs}.ln_1", cfg) + norm(f"{ours}.ffn_norm", f"{theirs}.ln_2", cfg)
        qkv = tuple(f"{ours}.attention.{p}_proj" for p in "qkv")
        rules.append(Rule(tuple(f"{n}.weight" for n in qkv), (f"{theirs}.attn.c_attn.weight",), "fused_t"))
        rules.append(Rule(tuple(f"{n}.bias" for n in qkv), (f"{theirs}.attn.c_attn.bias",), "fused"))
        for o, t in (
            ("attention.o_proj", "attn.c_proj"),
            ("feed_forward.up_proj", "mlp.c_fc"),
            ("feed_forward.down_proj", "mlp.c_proj"),
        ):
            rules += [
                Rule((f"{ours}.{o}.weight",), (f"{theirs}.{t}.weight",), "t"),
                copy(f"{ours}.{o}.bias", f"{theirs}.{t}.bias"),
            ]
    return rules


FAMILIES = {
    "gpt2": Family(
        "gpt2", "GPT2LMHeadModel", _gpt2_from_hf, _gpt2_to_hf, _gpt2_rules, (".attn.bias", ".attn.masked_bias")
    ),
}
