"""What every family mapping uses: weight-name rules, the Family record, RoPE and head helpers."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tessera.config import ConfigError, ModelConfig
from tessera.model.ffn import ffn_hidden_size


class HFConversionError(ConfigError):
    """An HF checkpoint or tessera config that cannot be converted exactly; names the option (a user error, exit 2)."""


@dataclass(frozen=True)
class Rule:
    """How tessera tensor(s) ``ours`` map to HF tensor(s) ``theirs``.

    kind: ``copy`` (1:1), ``t`` (transposed, GPT-2 Conv1D), ``fused`` / ``fused_t`` (our q, k, v
    concatenated along HF's output dim, transposed for Conv1D), ``experts`` (our (E, in, out)
    bank <-> E per-expert (out, in) HF matrices), ``interleaved`` / ``halves`` (our tensors side by side in
    HF's last dimension: alternating channels, gpt-oss's gate_up_proj, or one after the other, Llama 4's).
    """

    ours: tuple[str, ...]
    theirs: tuple[str, ...]
    kind: str = "copy"


@dataclass(frozen=True)
class Family:
    """One HF model family: its architecture class name, config and weight mappings."""

    name: str
    architecture: str
    from_hf: Callable[[dict[str, Any]], dict[str, Any]]
    to_hf: Callable[[ModelConfig], dict[str, Any]]
    rules: Callable[[ModelConfig, str], list[Rule]]
    ignored: tuple[str, ...] = ()  # HF tensor-name substrings that carry nothing tessera needs
    # Rewrites an HF checkpoint's tensors in place into the layout ``rules`` expect (hf config, tessera config).
    prepare: Callable[[dict[str, Any], ModelConfig, dict[str, Any]], None] | None = None
    # Rewrites exported HF tensors in place into the checkpoint's layout (the inverse of ``prepare``'s rewrite).
    finish: Callable[[ModelConfig, dict[str, Any]], None] | None = None


SPLIT_LAST = ("interleaved", "halves")  # the kinds that split HF's last dimension into our tensors


def split_last(t: torch.Tensor, part: int, parts: int, kind: str) -> torch.Tensor:
    """Our tensor ``part`` of ``parts`` in HF tensor ``t`` under a :data:`SPLIT_LAST` rule."""
    if kind == "interleaved":
        return t[..., part::parts]
    return t.chunk(parts, dim=-1)[part]


def join_last(tensors: list[torch.Tensor], kind: str) -> torch.Tensor:
    """The HF tensor of our ``tensors`` under a :data:`SPLIT_LAST` rule (the inverse of :func:`split_last`)."""
    if kind == "interleaved":
        return torch.stack(tensors, dim=-1).flatten(-2)
    return torch.cat(tensors, dim=-1)


def copy(ours: str, theirs: str) -> Rule:
    """A 1:1 tensor."""
    return Rule((ours,), (theirs,))


def ends_rules(cfg: ModelConfig, embed: str, final_norm: str) -> list[Rule]:
    """A decoder's ends: the token embedding, the final norm and (unless tied) the ``lm_head``."""
    rules = [copy("tok_embeddings.weight", embed), copy("norm.weight", final_norm)]
    return rules if cfg.tie_embeddings else [*rules, copy("output.weight", "lm_head.weight")]


def linear(ours: str, theirs: str, bias: bool) -> list[Rule]:
    """A linear layer's weight (and bias)."""
    rules = [copy(f"{ours}.weight", f"{theirs}.weight")]
    return rules + [copy(f"{ours}.bias", f"{theirs}.bias")] if bias else rules


def norm(ours: str, theirs: str, cfg: ModelConfig) -> list[Rule]:
    """A norm's weight (and bias for LayerNorm)."""
    return linear(ours, theirs, cfg.norm == "layernorm")


def fail(option: str, value: Any, family: str, hint: str = "") -> None:
    """Refuse an HF option tessera cannot reproduce."""
    raise HFConversionError(
        f"{family} option {option}={value!r} is not supported by tessera{'; ' + hint if hint else ''}"
    )


def get(hf: dict[str, Any], *keys: str, default: Any = None) -> Any:
    """The first of ``keys`` that ``hf`` sets (not None), else ``default``."""
    for key in keys:
        if hf.get(key) is not None:
            return hf[key]
    return default


def ffn_hidden(cfg: ModelConfig) -> int:
    """The dense FFN's resolved hidden width."""
    return ffn_hidden_size(cfg.dim, cfg.activation, cfg.ffn_hidden, cfg.ffn_multiplier, cfg.multiple_of)


def sizes_from_hf(hf: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """The [model] sizes a family's name table (ours -> HF's) reads from its HF config."""
    return {ours: hf[theirs] for ours, theirs in names.items()}


def sizes_to_hf(cfg: ModelConfig, names: dict[str, str]) -> dict[str, Any]:
    """The same table written back into an HF config (``ffn_hidden`` resolved to the width that runs)."""
    return {theirs: ffn_hidden(cfg) if ours == "ffn_hidden" else getattr(cfg, ours) for ours, theirs in names.items()}


def decoder_from_hf(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """The [model] keys every RMSNorm decoder family reads alike from its HF config (Llama, DeepSeek, Jamba);
    an activation tessera does not have is refused."""
    act = hf.get("hidden_act", "silu")
    if act not in ACT_IN:
        fail("hidden_act", act, family)
    return {
        "vocab_size": hf["vocab_size"],
        "dim": hf["hidden_size"],
        "n_layers": hf["num_hidden_layers"],
        "n_heads": hf["num_attention_heads"],
        "ffn_hidden": hf["intermediate_size"],
        "activation": ACT_IN[act],
        "norm": "rmsnorm",
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "max_seq_len": hf["max_position_embeddings"],
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }


def decoder_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The HF config keys every RMSNorm decoder family writes alike (Llama, DeepSeek, Jamba)."""
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": ffn_hidden(cfg),
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads or cfg.n_heads,
        "hidden_act": ACT_OUT.get(cfg.activation, cfg.activation),
        "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings,
    }


def heads(hf: dict[str, Any], dim: int, n_heads: int) -> dict[str, Any]:
    """``head_dim`` (0 when it is dim // n_heads)."""
    head_dim = get(hf, "head_dim", default=dim // n_heads)
    return {"head_dim": 0 if head_dim == dim // n_heads else int(head_dim)}


ACT_IN = {"silu": "swiglu", "swish": "swiglu", "gelu_pytorch_tanh": "geglu", "gelu_new": "geglu"}
ACT_OUT = {"swiglu": "silu", "geglu": "gelu_pytorch_tanh"}


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def rope_params(hf: dict[str, Any]) -> dict[str, Any]:
    """The RoPE parameters of an HF config in either form: transformers 5 ``rope_parameters`` or 4.x
    top-level ``rope_theta`` + ``rope_scaling`` (5.x, too, prefers ``rope_scaling`` when both are there)."""
    params = dict(get(hf, "rope_scaling", "rope_parameters", default={}) or {})
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def rope_from_hf(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """The ``[model.position]`` of an HF config's RoPE (default, linear, yarn or llama3)."""
    params = rope_params(hf)
    kind = params["rope_type"]
    out: dict[str, Any] = {"kind": "rope", "rope_theta": float(params["rope_theta"])}
    if float(get(hf, "partial_rotary_factor", default=params.get("partial_rotary_factor", 1.0))) != 1.0:
        fail("partial_rotary_factor", hf.get("partial_rotary_factor"), family)
    if kind == "default":
        return out
    if kind not in ("linear", "yarn", "llama3"):
        fail("rope_parameters.rope_type", kind, family, "supported: default, linear, yarn, llama3")
    factor = float(params["factor"])
    out.update(rope_scaling=kind, rope_scaling_factor=factor)
    original = int(params.get("original_max_position_embeddings") or hf["max_position_embeddings"] / factor)
    if kind == "llama3":
        out.update(
            rope_original_max_len=int(params.get("original_max_position_embeddings") or hf["max_position_embeddings"]),
            rope_low_freq_factor=float(params["low_freq_factor"]),
            rope_high_freq_factor=float(params["high_freq_factor"]),
        )
    elif kind == "yarn":
        for key, default in (("beta_fast", 32), ("beta_slow", 1)):
            if params.get(key) not in (None, default):
                fail(f"rope_parameters.{key}", params[key], family)
        out["rope_original_max_len"] = original
        if params.get("truncate") is not None:
            out["rope_yarn_truncate"] = bool(params["truncate"])
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        if params.get("attention_factor") is not None:
            out["rope_attention_factor"] = float(params["attention_factor"])
        elif mscale and mscale_all:
            out["rope_attention_factor"] = _mscale(factor, mscale) / _mscale(factor, mscale_all)
    return out


def rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """RoPE in both forms: ``rope_parameters`` (transformers 5) and ``rope_theta`` + ``rope_scaling`` (4.x)."""
    pos = cfg.position
    if pos.rope_scaling == "ntk":
        raise HFConversionError(
            "model.position.rope_scaling='ntk' (static NTK) cannot be expressed in an HF checkpoint; use linear, "
            "yarn or llama3"
        )
    scaling: dict[str, Any] | None = None
    if pos.rope_scaling != "none":
        scaling = {"rope_type": pos.rope_scaling, "factor": pos.rope_scaling_factor}
        original = pos.rope_original_max_len or int(cfg.max_seq_len / pos.rope_scaling_factor)
        if pos.rope_scaling in ("yarn", "llama3"):
            scaling["original_max_position_embeddings"] = original
        if pos.rope_scaling == "llama3":
            scaling.update(low_freq_factor=pos.rope_low_freq_factor, high_freq_factor=pos.rope_high_freq_factor)
        if pos.rope_scaling == "yarn" and pos.rope_attention_factor:
            scaling["attention_factor"] = pos.rope_attention_factor
        if pos.rope_scaling == "yarn" and not pos.rope_yarn_truncate:
            scaling["truncate"] = False
    parameters = {"rope_theta": pos.rope_theta, "rope_type": "default", **(scaling or {})}
    return {"rope_parameters": parameters, "rope_theta": pos.rope_theta, "rope_scaling": scaling}
