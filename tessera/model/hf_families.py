"""Per-family mappings between HF transformers checkpoints and tessera: configs and weight names.

Each family has ``from_hf`` (HF config.json dict -> ModelConfig keyword args, raising
:class:`HFConversionError` for any option tessera cannot reproduce), ``to_hf`` (ModelConfig -> HF
config dict) and ``rules`` (ModelConfig -> weight-name rules, see :class:`Rule`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tessera.config import ConfigError, ModelConfig
from tessera.model.ffn import ffn_hidden_size
from tessera.model.moe import is_moe_layer


class HFConversionError(ConfigError):
    """An HF checkpoint or tessera config that cannot be converted exactly; names the option (a user error, exit 2)."""


@dataclass(frozen=True)
class Rule:
    """How tessera tensor(s) ``ours`` map to HF tensor(s) ``theirs``.

    kind: ``copy`` (1:1), ``t`` (transposed, GPT-2 Conv1D), ``fused`` / ``fused_t`` (our q, k, v
    concatenated along HF's output dim, transposed for Conv1D), ``experts`` (our (E, in, out)
    bank <-> E per-expert (out, in) HF matrices).
    """

    ours: tuple[str, ...]
    theirs: tuple[str, ...]
    kind: str = "copy"


def _copy(ours: str, theirs: str) -> Rule:
    return Rule((ours,), (theirs,))


def _linear(ours: str, theirs: str, bias: bool) -> list[Rule]:
    rules = [_copy(f"{ours}.weight", f"{theirs}.weight")]
    return rules + [_copy(f"{ours}.bias", f"{theirs}.bias")] if bias else rules


def _norm(ours: str, theirs: str, cfg: ModelConfig) -> list[Rule]:
    return _linear(ours, theirs, cfg.norm == "layernorm")


def _fail(option: str, value: Any, family: str, hint: str = "") -> None:
    raise HFConversionError(
        f"{family} option {option}={value!r} is not supported by tessera{'; ' + hint if hint else ''}"
    )


def _get(hf: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if hf.get(key) is not None:
            return hf[key]
    return default


# --- shared pieces -----------------------------------------------------------------------------

_ACT_IN = {"silu": "swiglu", "swish": "swiglu", "gelu_pytorch_tanh": "geglu", "gelu_new": "geglu"}
_ACT_OUT = {"swiglu": "silu", "geglu": "gelu_pytorch_tanh"}


def _rope_from_hf(hf: dict[str, Any], family: str) -> dict[str, Any]:
    params = dict(_get(hf, "rope_parameters", "rope_scaling", default={}) or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    out: dict[str, Any] = {"position": "rope", "rope_theta": theta}
    if float(_get(hf, "partial_rotary_factor", default=params.get("partial_rotary_factor", 1.0))) != 1.0:
        _fail("partial_rotary_factor", hf.get("partial_rotary_factor"), family)
    if kind == "default":
        return out
    if kind not in ("linear", "yarn"):
        _fail("rope_parameters.rope_type", kind, family, "supported: default, linear, yarn")
    out.update(rope_scaling=kind, rope_scaling_factor=float(params["factor"]))
    if kind == "yarn":
        for key, default in (
            ("attention_factor", None),
            ("mscale", None),
            ("mscale_all_dim", None),
            ("beta_fast", 32),
            ("beta_slow", 1),
            ("truncate", True),
        ):
            if params.get(key) not in (None, default):
                _fail(f"rope_parameters.{key}", params[key], family)
        out["rope_original_max_len"] = int(
            params.get("original_max_position_embeddings") or hf["max_position_embeddings"] / params["factor"]
        )
    return out


def _rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    params: dict[str, Any] = {
        "rope_theta": cfg.position.rope_theta,
        "rope_type": "default" if cfg.position.rope_scaling == "none" else cfg.position.rope_scaling,
    }
    if cfg.position.rope_scaling != "none":
        params["factor"] = cfg.position.rope_scaling_factor
    if cfg.position.rope_scaling == "yarn":
        params["original_max_position_embeddings"] = cfg.position.rope_original_max_len or int(
            cfg.max_seq_len / cfg.position.rope_scaling_factor
        )
    return {"rope_parameters": params}


def _heads(hf: dict[str, Any], dim: int, n_heads: int) -> dict[str, Any]:
    head_dim = _get(hf, "head_dim", default=dim // n_heads)
    return {"head_dim": 0 if head_dim == dim // n_heads else int(head_dim)}


def _llama_from_hf(hf: dict[str, Any], family: str) -> dict[str, Any]:
    act = hf.get("hidden_act", "silu")
    if act not in _ACT_IN:
        _fail("hidden_act", act, family)
    if hf.get("mlp_bias"):
        _fail("mlp_bias", True, family)
    if hf.get("attention_bias") and family == "llama":
        _fail("attention_bias", True, family, "Llama puts a bias on o_proj too, which tessera ties to model.bias")
    dim, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    out = dict(
        vocab_size=hf["vocab_size"],
        dim=dim,
        n_layers=hf["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=_get(hf, "num_key_value_heads", default=n_heads),
        ffn_hidden=hf["intermediate_size"],
        activation=_ACT_IN[act],
        norm="rmsnorm",
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_seq_len=hf["max_position_embeddings"],
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2",
        **_heads(hf, dim, n_heads),
        **_rope_from_hf(hf, family),
    )
    return out


def _llama_to_hf(cfg: ModelConfig, family: str) -> dict[str, Any]:
    hf = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads or cfg.n_heads,
        "head_dim": cfg.head_dim or cfg.dim // cfg.n_heads,
        "intermediate_size": ffn_hidden_size(
            cfg.dim, cfg.activation, cfg.ffn_hidden, cfg.ffn_multiplier, cfg.multiple_of
        ),
        "hidden_act": _ACT_OUT.get(cfg.activation, cfg.activation),
        "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings,
        **_rope_to_hf(cfg),
    }
    if family == "llama":
        hf.update(attention_bias=False, mlp_bias=False)
    return hf


def _llama_rules(cfg: ModelConfig, family: str) -> list[Rule]:
    rules = [_copy("tok_embeddings.weight", "model.embed_tokens.weight"), _copy("norm.weight", "model.norm.weight")]
    if not cfg.tie_embeddings:
        rules.append(_copy("output.weight", "lm_head.weight"))
    moe = "block_sparse_moe" if family == "mixtral" else "mlp"
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i}", f"model.layers.{i}"
        rules += [
            _copy(f"{ours}.attention_norm.weight", f"{theirs}.input_layernorm.weight"),
            _copy(f"{ours}.ffn_norm.weight", f"{theirs}.post_attention_layernorm.weight"),
        ]
        for p in "qkv":
            rules += _linear(f"{ours}.attention.{p}_proj", f"{theirs}.self_attn.{p}_proj", cfg.attention.qkv_bias)
        rules.append(_copy(f"{ours}.attention.o_proj.weight", f"{theirs}.self_attn.o_proj.weight"))
        if is_moe_layer(cfg, i):
            rules.append(_copy(f"{ours}.moe.router.weight", f"{theirs}.{moe}.gate.weight"))
            for name, w in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
                experts = tuple(f"{theirs}.{moe}.experts.{e}.{w}.weight" for e in range(cfg.moe.experts))
                rules.append(Rule((f"{ours}.moe.experts.{name}",), experts, "experts"))
        else:
            for p in ("gate_proj", "up_proj", "down_proj"):
                rules.append(_copy(f"{ours}.feed_forward.{p}.weight", f"{theirs}.mlp.{p}.weight"))
    return rules


def _mistral_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    return {**_llama_from_hf(hf, "mistral"), "sliding_window": int(hf.get("sliding_window") or 0)}


def _qwen2_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    out = _llama_from_hf(hf, "qwen2")
    if hf.get("use_sliding_window"):
        if int(hf.get("max_window_layers", 0)) not in (0,):
            _fail(
                "use_sliding_window with max_window_layers",
                hf.get("max_window_layers"),
                "qwen2",
                "per-layer windows are not supported; only max_window_layers=0 (all layers)",
            )
        out["sliding_window"] = int(hf["sliding_window"])
    return out


def _qwen2_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    hf = _llama_to_hf(cfg, "qwen2")
    if cfg.attention.sliding_window:
        hf.update(use_sliding_window=True, sliding_window=cfg.attention.sliding_window, max_window_layers=0)
    else:
        hf.update(use_sliding_window=False)
    return hf


def _mixtral_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    if float(hf.get("router_jitter_noise") or 0.0) != 0.0:
        _fail("router_jitter_noise", hf["router_jitter_noise"], "mixtral")
    return {
        **_mistral_from_hf(hf),
        "moe_experts": hf["num_local_experts"],
        "moe_top_k": hf["num_experts_per_tok"],
        "moe_router": "topk_softmax",
        "moe_aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.001)),
    }


def _mixtral_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        **_llama_to_hf(cfg, "mixtral"),
        "sliding_window": cfg.attention.sliding_window or None,
        "num_local_experts": cfg.moe.experts,
        "num_experts_per_tok": cfg.moe.top_k,
        "router_aux_loss_coef": cfg.moe.aux_loss_coef,
        "router_jitter_noise": 0.0,
    }


# --- GPT-2 ---------------------------------------------------------------------------------------

_GPT2_ACT = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}


def _gpt2_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    for key in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
        if hf.get(key):
            _fail(key, True, "gpt2")
    act = hf.get("activation_function", "gelu_new")
    if act not in _GPT2_ACT:
        _fail("activation_function", act, "gpt2")
    dim = hf["n_embd"]
    return dict(
        vocab_size=hf["vocab_size"],
        dim=dim,
        n_layers=hf["n_layer"],
        n_heads=hf["n_head"],
        ffn_hidden=hf.get("n_inner") or 4 * dim,
        activation=_GPT2_ACT[act],
        norm="layernorm",
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        position="learned",
        max_seq_len=hf["n_positions"],
        qkv_bias=True,
        bias=True,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        attn_scale=0.0 if hf.get("scale_attn_weights", True) else 1.0,
    )


def _gpt2_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "vocab_size": cfg.vocab_size,
        "n_embd": cfg.dim,
        "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads,
        "n_positions": cfg.max_seq_len,
        "n_inner": ffn_hidden_size(cfg.dim, cfg.activation, cfg.ffn_hidden, cfg.ffn_multiplier, cfg.multiple_of),
        "activation_function": {"gelu_tanh": "gelu_new"}.get(cfg.activation, cfg.activation),
        "layer_norm_epsilon": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "scale_attn_weights": cfg.attention.scale == 0.0,
    }


def _gpt2_rules(cfg: ModelConfig, family: str) -> list[Rule]:
    rules = [
        _copy("tok_embeddings.weight", "transformer.wte.weight"),
        _copy("pos_embeddings.weight", "transformer.wpe.weight"),
    ]
    rules += _norm("norm", "transformer.ln_f", cfg)
    if not cfg.tie_embeddings:
        rules.append(_copy("output.weight", "lm_head.weight"))
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i}", f"transformer.h.{i}"
        rules += _norm(f"{ours}.attention_norm", f"{theirs}.ln_1", cfg) + _norm(
            f"{ours}.ffn_norm", f"{theirs}.ln_2", cfg
        )
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
                _copy(f"{ours}.{o}.bias", f"{theirs}.{t}.bias"),
            ]
    return rules


# --- BERT ----------------------------------------------------------------------------------------

_BERT_ACT = {"gelu": "gelu", "gelu_new": "gelu_tanh", "relu": "relu"}


def _bert_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    act = hf.get("hidden_act", "gelu")
    if act not in _BERT_ACT:
        _fail("hidden_act", act, "bert")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        _fail("position_embedding_type", hf["position_embedding_type"], "bert")
    if hf.get("is_decoder") or hf.get("add_cross_attention"):
        _fail("is_decoder", True, "bert")
    return dict(
        arch="encoder",
        vocab_size=hf["vocab_size"],
        dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"],
        ffn_hidden=hf["intermediate_size"],
        activation=_BERT_ACT[act],
        norm="layernorm",
        norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
        norm_position="post",
        embed_norm=True,
        type_vocab_size=hf.get("type_vocab_size", 2),
        position="learned",
        max_seq_len=hf["max_position_embeddings"],
        qkv_bias=True,
        bias=True,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
    )


def _bert_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "intermediate_size": ffn_hidden_size(
            cfg.dim, cfg.activation, cfg.ffn_hidden, cfg.ffn_multiplier, cfg.multiple_of
        ),
        "hidden_act": {"gelu_tanh": "gelu_new"}.get(cfg.activation, cfg.activation),
        "layer_norm_eps": cfg.norm_eps,
        "type_vocab_size": cfg.type_vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "position_embedding_type": "absolute",
        "tie_word_embeddings": cfg.tie_embeddings,
    }


def _bert_rules(cfg: ModelConfig, family: str) -> list[Rule]:
    e = "bert.embeddings"
    rules = [
        _copy("tok_embeddings.weight", f"{e}.word_embeddings.weight"),
        _copy("pos_embeddings.weight", f"{e}.position_embeddings.weight"),
        _copy("type_embeddings.weight", f"{e}.token_type_embeddings.weight"),
    ]
    rules += _norm("embed_norm", f"{e}.LayerNorm", cfg)
    rules += _linear("head.dense", "cls.predictions.transform.dense", True) + _norm(
        "head.norm", "cls.predictions.transform.LayerNorm", cfg
    )
    rules.append(_copy("output.bias", "cls.predictions.bias"))
    if not cfg.tie_embeddings:
        rules.append(_copy("output.weight", "cls.predictions.decoder.weight"))
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i}", f"bert.encoder.layer.{i}"
        for p, name in (("q", "query"), ("k", "key"), ("v", "value")):
            rules += _linear(f"{ours}.attention.{p}_proj", f"{theirs}.attention.self.{name}", True)
        rules += _linear(f"{ours}.attention.o_proj", f"{theirs}.attention.output.dense", True) + _norm(
            f"{ours}.attention_norm", f"{theirs}.attention.output.LayerNorm", cfg
        )
        rules += _linear(f"{ours}.feed_forward.up_proj", f"{theirs}.intermediate.dense", True) + _linear(
            f"{ours}.feed_forward.down_proj", f"{theirs}.output.dense", True
        )
        rules += _norm(f"{ours}.ffn_norm", f"{theirs}.output.LayerNorm", cfg)
    return rules


# --- T5 ------------------------------------------------------------------------------------------


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
        _fail("feed_forward_proj", proj, "t5")
    tied = bool(hf.get("tie_word_embeddings", True))
    return dict(
        arch="encoder_decoder",
        vocab_size=hf["vocab_size"],
        dim=hf["d_model"],
        head_dim=hf["d_kv"],
        n_heads=hf["num_heads"],
        n_layers=hf["num_layers"],
        n_decoder_layers=_get(hf, "num_decoder_layers", default=hf["num_layers"]),
        ffn_hidden=hf["d_ff"],
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
    proj = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_new", "geglu": "gated-gelu", "swiglu": "gated-silu"}[
        cfg.activation
    ]
    return {
        "vocab_size": cfg.vocab_size,
        "d_model": cfg.dim,
        "d_kv": cfg.head_dim or cfg.dim // cfg.n_heads,
        "num_heads": cfg.n_heads,
        "num_layers": cfg.n_layers,
        "num_decoder_layers": cfg.n_decoder_layers or cfg.n_layers,
        "d_ff": ffn_hidden_size(cfg.dim, cfg.activation, cfg.ffn_hidden, cfg.ffn_multiplier, cfg.multiple_of),
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
    return [_copy(f"{ours}.feed_forward.{o}.weight", f"{theirs}.DenseReluDense.{t}.weight") for o, t in pairs]


def _t5_attention(ours: str, theirs: str) -> list[Rule]:
    return [_copy(f"{ours}.{p}_proj.weight", f"{theirs}.{p}.weight") for p in "qkvo"]


def _t5_rules(cfg: ModelConfig, family: str) -> list[Rule]:
    rules = [_copy("tok_embeddings.weight", "shared.weight")]
    if not cfg.tie_embeddings:
        rules.append(_copy("output.weight", "lm_head.weight"))
    for stack, n in (("encoder", cfg.n_layers), ("decoder", cfg.n_decoder_layers or cfg.n_layers)):
        rules += [
            _copy(
                f"{stack}.rel_bias.relative_attention_bias.weight",
                f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
            ),
            _copy(f"{stack}.norm.weight", f"{stack}.final_layer_norm.weight"),
        ]
        for i in range(n):
            ours, theirs = f"{stack}.layers.{i}", f"{stack}.block.{i}.layer"
            rules += _t5_attention(f"{ours}.attention", f"{theirs}.0.SelfAttention") + [
                _copy(f"{ours}.attention_norm.weight", f"{theirs}.0.layer_norm.weight")
            ]
            ffn = 1
            if stack == "decoder":
                rules += _t5_attention(f"{ours}.cross_attention", f"{theirs}.1.EncDecAttention") + [
                    _copy(f"{ours}.cross_attention_norm.weight", f"{theirs}.1.layer_norm.weight")
                ]
                ffn = 2
            rules += _t5_ffn(ours, f"{theirs}.{ffn}", cfg) + [
                _copy(f"{ours}.ffn_norm.weight", f"{theirs}.{ffn}.layer_norm.weight")
            ]
    return rules


@dataclass(frozen=True)
class Family:
    """One HF model family: its architecture class name, config and weight mappings."""

    name: str
    architecture: str
    from_hf: Callable[[dict[str, Any]], dict[str, Any]]
    to_hf: Callable[[ModelConfig], dict[str, Any]]
    rules: Callable[[ModelConfig, str], list[Rule]]
    ignored: tuple[str, ...] = ()  # HF tensor-name substrings that carry nothing tessera needs


FAMILIES: dict[str, Family] = {
    "llama": Family(
        "llama",
        "LlamaForCausalLM",
        lambda hf: _llama_from_hf(hf, "llama"),
        lambda c: _llama_to_hf(c, "llama"),
        _llama_rules,
        ("rotary_emb.inv_freq",),
    ),
    "mistral": Family(
        "mistral",
        "MistralForCausalLM",
        _mistral_from_hf,
        lambda c: {**_llama_to_hf(c, "mistral"), "sliding_window": c.attention.sliding_window or None},
        _llama_rules,
        ("rotary_emb.inv_freq",),
    ),
    "qwen2": Family("qwen2", "Qwen2ForCausalLM", _qwen2_from_hf, _qwen2_to_hf, _llama_rules, ("rotary_emb.inv_freq",)),
    "mixtral": Family(
        "mixtral", "MixtralForCausalLM", _mixtral_from_hf, _mixtral_to_hf, _llama_rules, ("rotary_emb.inv_freq",)
    ),
    "gpt2": Family(
        "gpt2", "GPT2LMHeadModel", _gpt2_from_hf, _gpt2_to_hf, _gpt2_rules, (".attn.bias", ".attn.masked_bias")
    ),
    "bert": Family(
        "bert",
        "BertForMaskedLM",
        _bert_from_hf,
        _bert_to_hf,
        _bert_rules,
        ("bert.pooler.", "cls.seq_relationship.", "position_ids", "cls.predictions.decoder."),
    ),
    "t5": Family(
        "t5",
        "T5ForConditionalGeneration",
        _t5_from_hf,
        _t5_to_hf,
        _t5_rules,
        ("encoder.embed_tokens.", "decoder.embed_tokens."),
    ),
}
