"""State-space families: Mamba (MambaForCausalLM), Mamba-2 (Mamba2ForCausalLM) and the Jamba hybrid."""

from __future__ import annotations

import math
from typing import Any

from tessera.config import ModelConfig
from tessera.model.block import layer_kind
from tessera.hf.families.common import Family, Rule, copy, ends_rules, fail, get, linear, decoder_to_hf, decoder_from_hf
from tessera.hf.families.llama import attention_rules, dense_ffn_rules, expert_rules
from tessera.model.moe import is_moe_layer

_MAX_LEN = 2048  # Mamba has no context limit; tessera's max_seq_len (generation's cap) travels as an extra key


def compress_pattern(letters: str) -> str:
    """The shortest prefix of ``letters`` that repeats to it exactly (``"MAMA"`` -> ``"MA"``)."""
    n = len(letters)
    for size in range(1, n + 1):
        if n % size == 0 and letters[:size] * (n // size) == letters:
            return letters[:size]
    return letters


def _dt_rank(value: Any, dim: int) -> int:
    """``time_step_rank``: "auto" means ceil(dim / 16), tessera's 0."""
    rank = math.ceil(dim / 16) if value in (None, "auto") else int(value)
    return 0 if rank == math.ceil(dim / 16) else rank


def _check_act(hf: dict[str, Any], family: str, key: str = "hidden_act") -> None:
    if hf.get(key, "silu") != "silu":
        fail(key, hf[key], family)


def _ssm_from_hf(hf: dict[str, Any], family: str, tied: bool, state: int, **mamba: Any) -> dict[str, Any]:
    """What the configs of Mamba and Mamba-2 (``family``) share; ``tied`` and ``state`` are HF's defaults of
    tie_word_embeddings and state_size, ``mamba`` the version's own [model.mamba] keys."""
    _check_act(hf, family)
    return {
        "vocab_size": hf["vocab_size"],
        "dim": hf["hidden_size"],
        "n_layers": hf["num_hidden_layers"],
        "n_heads": 1,
        "norm": "rmsnorm",
        "norm_eps": float(hf.get("layer_norm_epsilon", 1e-5)),
        "max_seq_len": int(hf.get("max_position_embeddings") or _MAX_LEN),
        "layer_pattern": "M",
        "position": {"kind": "none"},
        "tie_embeddings": bool(hf.get("tie_word_embeddings", tied)),
        "mamba": {
            "state": hf.get("state_size", state),
            "conv": hf.get("conv_kernel", 4),
            "conv_bias": bool(hf.get("use_conv_bias", True)),
            "proj_bias": bool(hf.get("use_bias", False)),
            "ffn": False,
            **mamba,
        },
    }


def _mamba_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    expand, dt_rank = hf.get("expand", 2), _dt_rank(hf.get("time_step_rank"), hf["hidden_size"])
    return _ssm_from_hf(hf, "mamba", True, 16, version=1, expand=expand, dt_rank=dt_rank)


def _ssm_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    m = cfg.mamba
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "layer_norm_epsilon": cfg.norm_eps,
        "state_size": m.state,
        "conv_kernel": m.conv,
        "expand": m.expand,
        "use_conv_bias": m.conv_bias,
        "use_bias": m.proj_bias,
        "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.max_seq_len,
    }


def _mamba_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {**_ssm_to_hf(cfg), "time_step_rank": cfg.mamba.dt_rank or "auto"}


def _mamba2_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    # transformers 5 writes infinity as {"__float__": "Infinity"}, 4.x as the JSON extension Infinity
    limit = [float(x["__float__"] if isinstance(x, dict) else x) for x in hf.get("time_step_limit", (0.0, math.inf))]
    if limit != [0.0, math.inf]:
        fail("time_step_limit", hf["time_step_limit"], "mamba2", "only the unclamped (0.0, inf) is supported")
    dim, expand = hf["hidden_size"], hf.get("expand", 2)
    if hf["num_heads"] * hf["head_dim"] != expand * dim:
        fail("num_heads", hf["num_heads"], "mamba2", "num_heads * head_dim must equal expand * hidden_size")
    own = {"expand": expand, "head_dim": hf["head_dim"], "groups": hf.get("n_groups", 1)}
    return _ssm_from_hf(hf, "mamba2", False, 128, version=2, chunk=hf.get("chunk_size", 256), **own)


def _mamba2_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    m = cfg.mamba
    heads = m.expand * cfg.dim // m.head_dim
    return {**_ssm_to_hf(cfg), "num_heads": heads, "head_dim": m.head_dim, "n_groups": m.groups, "chunk_size": m.chunk}


def mixer_rules(cfg: ModelConfig, ours: str, theirs: str) -> list[Rule]:
    """A Mamba / Mamba-2 mixer's weights (HF and tessera share the names)."""
    names = ["A_log", "D"] + (["dt_bias", "norm.weight"] if cfg.mamba.version == 2 else [])
    rules = [copy(f"{ours}.{n}", f"{theirs}.{n}") for n in names]
    rules += linear(f"{ours}.conv1d", f"{theirs}.conv1d", cfg.mamba.conv_bias)
    rules += linear(f"{ours}.in_proj", f"{theirs}.in_proj", cfg.mamba.proj_bias)
    rules += linear(f"{ours}.out_proj", f"{theirs}.out_proj", cfg.mamba.proj_bias)
    if cfg.mamba.version == 1:
        rules += [copy(f"{ours}.x_proj.weight", f"{theirs}.x_proj.weight")]
        rules += linear(f"{ours}.dt_proj", f"{theirs}.dt_proj", True)
    if cfg.mamba.dt_norm:
        rules += [copy(f"{ours}.{n}_layernorm.weight", f"{theirs}.{n}_layernorm.weight") for n in ("dt", "b", "c")]
    return rules


def _mamba_rules(cfg: ModelConfig, family: str) -> list[Rule]:
    rules = ends_rules(cfg, "backbone.embeddings.weight", "backbone.norm_f.weight")
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i}", f"backbone.layers.{i}"
        rules += [copy(f"{ours}.mamba_norm.weight", f"{theirs}.norm.weight")]
        rules += mixer_rules(cfg, f"{ours}.mamba", f"{theirs}.mixer")
    return rules


# --- Jamba ---------------------------------------------------------------------------------------


def _jamba_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    _check_act(hf, "jamba")
    if hf.get("sliding_window") is not None:
        fail("sliding_window", hf["sliding_window"], "jamba")
    n, dim = hf["num_hidden_layers"], hf["hidden_size"]
    period, offset = hf.get("attn_layer_period", 8), hf.get("attn_layer_offset", 4)
    out = {
        **decoder_from_hf(hf, "jamba"),
        "n_kv_heads": get(hf, "num_key_value_heads", default=hf["num_attention_heads"]),
        "max_seq_len": int(hf.get("max_position_embeddings") or 262144),
        "layer_pattern": compress_pattern("".join("A" if i % period == offset else "M" for i in range(n))),
        "position": {"kind": "none"},
        "mamba": {
            "version": 1,
            "state": hf.get("mamba_d_state", 16),
            "conv": hf.get("mamba_d_conv", 4),
            "expand": hf.get("mamba_expand", 2),
            "dt_rank": _dt_rank(hf.get("mamba_dt_rank"), dim),
            "conv_bias": bool(hf.get("mamba_conv_bias", True)),
            "proj_bias": bool(hf.get("mamba_proj_bias", False)),
            "dt_norm": True,
            "ffn": True,
        },
    }
    experts = hf.get("num_experts", 16)
    if experts > 1:
        every, first = hf.get("expert_layer_period", 2), hf.get("expert_layer_offset", 1)
        if first != every - 1:
            fail("expert_layer_offset", first, "jamba", "tessera places MoE on layers i with (i + 1) % period == 0")
        out["moe"] = {
            "experts": experts,
            "top_k": hf.get("num_experts_per_tok", 2),
            "every": every,
            "router": "softmax_topk",
            "aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.001)),
        }
    return out


def _jamba_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    m, n = cfg.mamba, cfg.n_layers
    attn = [i for i in range(n) if layer_kind(cfg, i) != "M"]
    # Jamba places attention on layers i % period == offset; an export that cannot is refused by the round trip.
    period = (attn[1] - attn[0] if len(attn) > 1 else n) if attn else n + 1
    return {
        **decoder_to_hf(cfg),
        "attn_layer_period": period,
        "attn_layer_offset": attn[0] % period if attn else n,
        "num_experts": cfg.moe.experts or 1,
        "num_experts_per_tok": cfg.moe.top_k if cfg.moe.experts else 1,
        "expert_layer_period": cfg.moe.every,
        "expert_layer_offset": cfg.moe.every - 1,
        "router_aux_loss_coef": cfg.moe.aux_loss_coef,
        "mamba_d_state": m.state,
        "mamba_d_conv": m.conv,
        "mamba_expand": m.expand,
        "mamba_dt_rank": m.dt_rank or "auto",
        "mamba_conv_bias": m.conv_bias,
        "mamba_proj_bias": m.proj_bias,
        "sliding_window": None,
        "use_mamba_kernels": False,
    }


def _jamba_rules(cfg: ModelConfig, family: str) -> list[Rule]:
    rules = ends_rules(cfg, "model.embed_tokens.weight", "model.final_layernorm.weight")
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i}", f"model.layers.{i}"
        rules.append(copy(f"{ours}.ffn_norm.weight", f"{theirs}.pre_ff_layernorm.weight"))
        if layer_kind(cfg, i) == "M":
            rules.append(copy(f"{ours}.mamba_norm.weight", f"{theirs}.input_layernorm.weight"))
            rules += mixer_rules(cfg, f"{ours}.mamba", f"{theirs}.mamba")
        else:
            rules.append(copy(f"{ours}.attention_norm.weight", f"{theirs}.input_layernorm.weight"))
            rules += attention_rules(cfg, ours, theirs)
        if is_moe_layer(cfg, i):
            rules.append(copy(f"{ours}.moe.router.weight", f"{theirs}.feed_forward.router.weight"))
            names = ("gate_proj", "up_proj", "down_proj")
            rules += expert_rules(f"{ours}.moe", f"{theirs}.feed_forward", cfg.moe.experts, names)
        else:
            rules += dense_ffn_rules(cfg, f"{ours}.feed_forward", f"{theirs}.feed_forward")
    return rules


FAMILIES = {
    "mamba": Family("mamba", "MambaForCausalLM", _mamba_from_hf, _mamba_to_hf, _mamba_rules),
    "mamba2": Family("mamba2", "Mamba2ForCausalLM", _mamba2_from_hf, _mamba2_to_hf, _mamba_rules),
    "jamba": Family("jamba", "JambaForCausalLM", _jamba_from_hf, _jamba_to_hf, _jamba_rules),
}
