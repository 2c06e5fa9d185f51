"""BERT (masked LM)."""

from __future__ import annotations

from typing import Any

from tessera.config import ModelConfig
from tessera.hf.families.common import Family, Rule, copy, fail, linear, norm, sizes_from_hf, sizes_to_hf

_BERT_ACT = {"gelu": "gelu", "gelu_new": "gelu_tanh", "relu": "relu"}
_SIZES = {
    "vocab_size": "vocab_size",
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "ffn_hidden": "intermediate_size",
    "max_seq_len": "max_position_embeddings",
}


def _bert_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    act = hf.get("hidden_act", "gelu")
    if act not in _BERT_ACT:
        fail("hidden_act", act, "bert")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        fail("position_embedding_type", hf["position_embedding_type"], "bert")
    if hf.get("is_decoder") or hf.get("add_cross_attention"):
        fail("is_decoder", True, "bert")
    return dict(
        sizes_from_hf(hf, _SIZES),
        arch="encoder",
        type_vocab_size=hf.get("type_vocab_size", 2),
        activation=_BERT_ACT[act],
        norm="layernorm",
        norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
        norm_position="post",
        embed_norm=True,
        position="learned",
        qkv_bias=True,
        bias=True,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
    )


def _bert_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        **sizes_to_hf(cfg, _SIZES),
        "hidden_act": {"gelu_tanh": "gelu_new"}.get(cfg.activation, cfg.activation),
        "layer_norm_eps": cfg.norm_eps,
        "type_vocab_size": cfg.type_vocab_size,
        "position_embedding_type": "absolute",
        "tie_word_embeddings": cfg.tie_embeddings,
    }


def _bert_rules(cfg: ModelConfig, family: str) -> list[Rule]:
    e = "bert.embeddings"
    rules = [
        copy("tok_embeddings.weight", f"{e}.word_embeddings.weight"),
        copy("pos_embeddings.weight", f"{e}.position_embeddings.weight"),
        copy("type_embeddings.weight", f"{e}.token_type_embeddings.weight"),
    ]
    rules += norm("embed_norm", f"{e}.LayerNorm", cfg)
    rules += linear("head.dense", "cls.predictions.transform.dense", True) + norm(
        "head.norm", "cls.predictions.transform.LayerNorm", cfg
    )
    rules.append(copy("output.bias", "cls.predictions.bias"))
    if not cfg.tie_embeddings:
        rules.append(copy("output.weight", "cls.predictions.decoder.weight"))
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i}", f"bert.encoder.layer.{i}"
        for p, name in (("q", "query"), ("k", "key"), ("v", "value")):
            rules += linear(f"{ours}.attention.{p}_proj", f"{theirs}.attention.self.{name}", True)
        rules += linear(f"{ours}.attention.o_proj", f"{theirs}.attention.output.dense", True) + norm(
            f"{ours}.attention_norm", f"{theirs}.attention.output.LayerNorm", cfg
        )
        rules += linear(f"{ours}.feed_forward.up_proj", f"{theirs}.intermediate.dense", True) + linear(
            f"{ours}.feed_forward.down_proj", f"{theirs}.output.dense", True
        )
        rules += norm(f"{ours}.ffn_norm", f"{theirs}.output.LayerNorm", cfg)
    return rules


FAMILIES = {
    "bert": Family(
        "bert",
        "BertForMaskedLM",
        _bert_from_hf,
        _bert_to_hf,
        _bert_rules,
        ("bert.pooler.", "cls.seq_relationship.", "position_ids", "cls.predictions.decoder."),
    ),
}
