"""T5 (v1.0 and v1.1, gated or not, tied or untied)."""

from __future__ import annotations

from typing import Any

from tessera.config import ModelConfig
from tessera.hf.families.common import Family, HFConversionError, Rule, copy, fail, get, sizes_from_hf, sizes_to_hf


_SIZES = {
    "vocab_size": "vocab_size",
    "dim": "d_model",
    "n_heads": "num_heads",
    "n_layers": "num_layers",
    "ffn_hidden": "d_ff",
}


def _t5_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    proj = hf.get("feed_forward_proj", "relu")
    gated = proj.startswith("gated-")
    act = "gelu_new" if proj == "gated-gelu" else proj.split("-")[-1]
    table = {
        (False, "relu"): "relu",
        (False, "gelu"): "gelu",
        (False, "gelu_new"): "gelu_tanh",
        (True, "gelu_new"): "geglu",
        (True, "silu"): "swiglu",
    }
    if (gated, act) not in table:
        fail("feed_forward_proj", proj, "t5")
    tied = bool(hf.get("tie_word_embeddings", True))
    return dict(
        sizes_from_hf(hf, _SIZES),
        arch="encoder_decoder",
        head_dim=hf["d_kv"],
        n_decoder_layers=get(hf, "num_decoder_layers", default=hf["num_layers"]),
        activation=table[(gated, act)],
        norm="rmsnorm",
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-6)),
        position="t5_bias",
        rel_buckets=hf.get("relative_attention_num_buckets", 32),
        rel_max_distance=hf.get("relative_attention_max_distance", 128),
        attn_scale=1.0,
        tie_embeddings=tied,
        output_dim_scale=bool(hf.get("scale_decoder_outputs", tied)),
        max_seq_len=int(hf.get("n_positions", 512)),
    )


def _t5_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    if cfg.output_dim_scale != cfg.tie_embeddings:
        raise HFConversionError(
            f"model.output_dim_scale={cfg.output_dim_scale} with model.tie_embeddings={cfg.tie_embeddings} cannot be "
            "expressed for transformers 4.x, which derives the output scaling from the tying; make them equal"
        )
    proj = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_new", "geglu": "gated-gelu", "swiglu": "gated-silu"}[
        cfg.activation
    ]
    return {
        **sizes_to_hf(cfg, _SIZES),
        "d_kv": cfg.head_dim or cfg.dim // cfg.n_heads,
        "num_decoder_layers": cfg.n_decoder_layers or cfg.n_layers,
        "feed_forward_proj": proj,
        "layer_norm_epsilon": cfg.norm_eps,
        "relative_attention_num_buckets": cfg.position.rel_buckets,
        "relative_attention_max_distance": cfg.position.rel_max_distance,
        "tie_word_embeddings": cfg.tie_embeddings,
        "scale_decoder_outputs": cfg.output_dim_scale,
        "n_positions": cfg.max_seq_len,
        "decoder_start_token_id": 0,
        "pad_token_id": 0,
        "is_encoder_decoder": True,
    }


def _t5_ffn(ours: str, theirs: str, cfg: ModelConfig) -> list[Rule]:
    if cfg.activation in ("geglu", "swiglu"):
        pairs = (("gate_proj", "wi_0"), ("up_proj", "wi_1"), ("down_proj", "wo"))
    else:
        pairs = (("up_proj", "wi"), ("down_proj", "wo"))
    return [copy(f"{ours}.feed_forward.{o}.weight", f"{theirs}.DenseReluDense.{t}.weight") for o, t in pairs]


def _t5_attention(ours: str, theirs: str) -> list[Rule]:
    return [copy(f"{ours}.{p}_proj.weight", f"{theirs}.{p}.weight") for p in "qkvo"]


def _t5_rules(cfg: ModelConfig, family: str) -> list[Rule]:
    rules = [copy("tok_embeddings.weight", "shared.weight")]
    if not cfg.tie_embeddings:
        rules.append(copy("output.weight", "lm_head.weight"))
    for stack, n in (("encoder", cfg.n_layers), ("decoder", cfg.n_decoder_layers or cfg.n_layers)):
        rules += [
            copy(
                f"{stack}.rel_bias.relative_attention_bias.weight",
                f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
            ),
            copy(f"{stack}.norm.weight", f"{stack}.final_layer_norm.weight"),
        ]
        for i in range(n):
            ours, theirs = f"{stack}.layers.{i}", f"{stack}.block.{i}.layer"
            rules += _t5_attention(f"{ours}.attention", f"{theirs}.0.SelfAttention") + [
                copy(f"{ours}.attention_norm.weight", f"{theirs}.0.layer_norm.weight")
            ]
            ffn = 1
            if stack == "decoder":
                rules += _t5_attention(f"{ours}.cross_attention", f"{theirs}.1.EncDecAttention") + [
                    copy(f"{ours}.cross_attention_norm.weight", f"{theirs}.1.layer_norm.weight")
                ]
                ffn = 2
            rules += _t5_ffn(ours, f"{theirs}.{ffn}", cfg) + [
                copy(f"{ours}.ffn_norm.weight", f"{theirs}.{ffn}.layer_norm.weight")
            ]
    return rules


FAMILIES = {
    "t5": Family(
        "t5",
        "T5ForConditionalGeneration",
        _t5_from_hf,
        _t5_to_hf,
        _t5_rules,
        ("encoder.embed_tokens.", "decoder.embed_tokens."),
    ),
}
