"""Llama and its close relatives: Llama (2, 3, 3.1, 3.2), Mistral, Qwen2 and Mixtral."""

from __future__ import annotations

from typing import Any

from tessera.config import ModelConfig
from tessera.hf.families.common import (
    Family,
    Rule,
    copy,
    decoder_to_hf,
    ends_rules,
    fail,
    get,
    heads,
    linear,
    rope_from_hf,
    rope_to_hf,
    decoder_from_hf,
)
from tessera.model.moe import is_moe_layer


def llama_from_hf(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """The ModelConfig keys of a Llama-like HF config (also the base of Mistral, Qwen2, Mixtral, the MoE families)."""
    out = decoder_from_hf(hf, family)
    dim, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    attention_bias = bool(hf.get("attention_bias", False))  # Llama: biases on q, k, v and o
    return {
        **out,
        "n_kv_heads": get(hf, "num_key_value_heads", default=n_heads),
        "ffn_bias": bool(hf.get("mlp_bias", False)),
        "attention": {"qkv_bias": attention_bias, "o_bias": attention_bias},
        "position": rope_from_hf(hf, family),
        **heads(hf, dim, n_heads),
    }


def _o_bias(cfg: ModelConfig) -> bool:
    return cfg.bias or cfg.attention.o_bias


def _ffn_bias(cfg: ModelConfig) -> bool:
    return cfg.bias or cfg.ffn_bias


def llama_to_hf(cfg: ModelConfig, family: str) -> dict[str, Any]:
    """The HF config of a Llama-like tessera config (exactness is checked by the caller)."""
    hf = {**decoder_to_hf(cfg), "head_dim": cfg.head_dim or cfg.dim // cfg.n_heads, **rope_to_hf(cfg)}
    if family == "llama":
        hf.update(attention_bias=cfg.attention.qkv_bias, mlp_bias=_ffn_bias(cfg))
    return hf


def layer_norm_rules(ours: str, theirs: str, mixer_norm: str = "attention_norm") -> list[Rule]:
    """A pre-norm layer's two norms under Llama's names: before the mixer (``mixer_norm``) and before the FFN."""
    return [
        copy(f"{ours}.{mixer_norm}.weight", f"{theirs}.input_layernorm.weight"),
        copy(f"{ours}.ffn_norm.weight", f"{theirs}.post_attention_layernorm.weight"),
    ]


def attention_rules(cfg: ModelConfig, ours: str, theirs: str, attn: str = "self_attn") -> list[Rule]:
    """q/k/v/o projections (and the q/k norms of Qwen3-style qk_norm); ``attn``: HF's attention module name."""
    rules: list[Rule] = []
    for p in "qkv":
        rules += linear(f"{ours}.attention.{p}_proj", f"{theirs}.{attn}.{p}_proj", cfg.attention.qkv_bias)
    rules += linear(f"{ours}.attention.o_proj", f"{theirs}.{attn}.o_proj", _o_bias(cfg))
    if cfg.attention.qk_norm:
        rules += [copy(f"{ours}.attention.{n}_norm.weight", f"{theirs}.{attn}.{n}_norm.weight") for n in "qk"]
    return rules


def dense_ffn_rules(cfg: ModelConfig, ours: str, theirs: str, bias: bool | None = None) -> list[Rule]:
    """A gated FFN as HF's ``mlp.{gate,up,down}_proj`` (with the model's FFN biases unless ``bias`` says)."""
    bias = _ffn_bias(cfg) if bias is None else bias
    return [r for p in ("gate_proj", "up_proj", "down_proj") for r in linear(f"{ours}.{p}", f"{theirs}.{p}", bias)]


def expert_rules(ours: str, theirs: str, n: int, names: tuple[str, str, str]) -> list[Rule]:
    """Our (E, in, out) expert bank <-> HF's per-expert (out, in) matrices named ``names`` (gate, up, down)."""
    return [
        Rule((f"{ours}.experts.{mine}",), tuple(f"{theirs}.experts.{e}.{hf}.weight" for e in range(n)), "experts")
        for mine, hf in zip(("gate_proj", "up_proj", "down_proj"), names)
    ]


def llama_layer_rules(cfg: ModelConfig, i: int) -> tuple[str, str, list[Rule]]:
    """Layer ``i``'s name prefixes (ours, HF's) and the rules of its two norms and attention projections."""
    ours, theirs = f"layers.{i}", f"model.layers.{i}"
    return ours, theirs, layer_norm_rules(ours, theirs) + attention_rules(cfg, ours, theirs)


def llama_rules(cfg: ModelConfig, family: str) -> list[Rule]:
    """Weight names of Llama, Mistral, Qwen2 and Mixtral."""
    rules = ends_rules(cfg, "model.embed_tokens.weight", "model.norm.weight")
    for i in range(cfg.n_layers):
        ours, theirs, layer = llama_layer_rules(cfg, i)
        rules += layer
        if is_moe_layer(cfg, i):
            rules.append(copy(f"{ours}.moe.router.weight", f"{theirs}.block_sparse_moe.gate.weight"))
            rules += expert_rules(f"{ours}.moe", f"{theirs}.block_sparse_moe", cfg.moe.experts, ("w1", "w3", "w2"))
        else:
            rules += dense_ffn_rules(cfg, f"{ours}.feed_forward", f"{theirs}.mlp")
    return rules


def _mistral_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    out = llama_from_hf(hf, "mistral")
    out["attention"]["sliding_window"] = int(hf.get("sliding_window") or 0)
    return out


def qwen2_layers_from_hf(hf: dict[str, Any], out: dict[str, Any], family: str) -> dict[str, Any]:
    """Qwen2's sliding windows: ``layer_types`` (or ``max_window_layers``: layers from there on slide) -> a
    ``layer_pattern`` of G (full) and A (windowed) layers."""
    window = int(hf.get("sliding_window") or 0) if hf.get("use_sliding_window") else 0
    if not window:
        return out
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types") or [
        "sliding_attention" if i >= int(hf.get("max_window_layers", 0)) else "full_attention" for i in range(n)
    ]
    bad = sorted(set(types) - {"sliding_attention", "full_attention"})
    if bad:
        fail("layer_types", bad[0], family)
    pattern = "".join("A" if t == "sliding_attention" else "G" for t in types)
    out["attention"]["sliding_window"] = window
    out["layer_pattern"] = "" if set(pattern) == {"A"} else pattern
    return out


def qwen2_layers_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """``use_sliding_window``, ``sliding_window`` and ``layer_types`` of a Qwen2-style export."""
    if not cfg.attention.sliding_window:
        return {"use_sliding_window": False, "sliding_window": None}
    pattern = cfg.layer_pattern or "A"
    types = ["full_attention" if pattern[i % len(pattern)] == "G" else "sliding_attention" for i in range(cfg.n_layers)]
    # max_window_layers as well, so readers that derive layer_types from it (transformers 4.x) agree.
    first_window = types.index("sliding_attention") if "sliding_attention" in types else cfg.n_layers
    return {
        "use_sliding_window": True,
        "sliding_window": cfg.attention.sliding_window,
        "max_window_layers": first_window,
        "layer_types": types,
    }


def _qwen2_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    out = llama_from_hf(hf, "qwen2")
    out["attention"].update(qkv_bias=True, o_bias=False)
    return qwen2_layers_from_hf(hf, out, "qwen2")


def _qwen2_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {**llama_to_hf(cfg, "qwen2"), **qwen2_layers_to_hf(cfg)}


def _mixtral_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    return {
        **_mistral_from_hf(hf),
        "moe": {
            "experts": hf["num_local_experts"],
            "top_k": hf["num_experts_per_tok"],
            "router": "topk_softmax",
            "aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.001)),
            "jitter": float(hf.get("router_jitter_noise") or 0.0),
        },
    }


def _mixtral_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        **llama_to_hf(cfg, "mixtral"),
        "sliding_window": cfg.attention.sliding_window or None,
        "num_local_experts": cfg.moe.experts,
        "num_experts_per_tok": cfg.moe.top_k,
        "router_aux_loss_coef": cfg.moe.aux_loss_coef,
        "router_jitter_noise": cfg.moe.jitter,
    }


_ROPE_BUFFERS = ("rotary_emb.inv_freq",)

FAMILIES = {
    "llama": Family(
        "llama",
        "LlamaForCausalLM",
        lambda hf: llama_from_hf(hf, "llama"),
        lambda c: llama_to_hf(c, "llama"),
        llama_rules,
        _ROPE_BUFFERS,
    ),
    "mistral": Family(
        "mistral",
        "MistralForCausalLM",
        _mistral_from_hf,
        lambda c: {**llama_to_hf(c, "mistral"), "sliding_window": c.attention.sliding_window or None},
        llama_rules,
        _ROPE_BUFFERS,
    ),
    "qwen2": Family("qwen2", "Qwen2ForCausalLM", _qwen2_from_hf, _qwen2_to_hf, llama_rules, _ROPE_BUFFERS),
    "mixtral": Family("mixtral", "MixtralForCausalLM", _mixtral_from_hf, _mixtral_to_hf, llama_rules, _ROPE_BUFFERS),
}
