"""Qwen3.5 text models: Qwen3_5ForCausalLM (``qwen3_5_text``, dense) and Qwen3_5MoeForCausalLM
(``qwen3_5_moe_text``), and the text part of the released multimodal checkpoints (``qwen3_5``, ``qwen3_5_moe``:
their ``text_config``, ``model.language_model.*`` weights; the vision tower and MTP head are not read).

The text model is Qwen3-Next's (Gated DeltaNet and gated attention 3:1, zero-centred RMSNorms, partial rotary)
with three differences, all handled here: the Gated DeltaNet input projections are four separate matrices
(q|k|v, z, b, a) rather than one per-key-head interleaved block (rewritten on import and export, an exact
permutation, so the weight rules are Qwen3-Next's); the MoE router always renormalizes its top-k and every layer
is MoE; and RoPE is multimodal (``mrope_section``). For text, the temporal, height and width position ids are
all the token index, so each section rotates by the same angle as plain RoPE: the sections cannot change a text
model's numbers and are written back as the released models' 11:11:10 split of the rotary half-width.
"""

from __future__ import annotations

from typing import Any

import torch

from tessera.config import ModelConfig
from tessera.hf.families.common import Family, HFConversionError, fail
from tessera.hf.families.qwen3_next import QWEN3_NEXT_IGNORED, qwen3_next_from_hf, qwen3_next_rules, qwen3_next_to_hf
from tessera.model.block import layer_kind

_MROPE_KEYS = ("mrope_section", "mrope_interleaved")
_VISION = ("model.visual.", "mtp.")
_LANGUAGE = "model.language_model."


def _text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """A composite (multimodal) config's text part, with the top-level tie flag where the text part lacks it."""
    if not isinstance(hf.get("text_config"), dict):
        return hf
    text = dict(hf["text_config"])
    text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", False))
    return text


def _without_mrope(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """``hf`` with the multimodal RoPE keys removed (text positions make every section plain RoPE)."""
    out = dict(hf)
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(out.get(key), dict):
            params = dict(out[key])
            section = params.get("mrope_section")
            if section is not None and not (isinstance(section, list) and all(isinstance(s, int) for s in section)):
                fail(f"{key}.mrope_section", section, family, "it must be a list of integers")
            out[key] = {k: v for k, v in params.items() if k not in _MROPE_KEYS}
    return out


def _from_hf(hf: dict[str, Any], family: str, moe: bool) -> dict[str, Any]:
    text = _without_mrope(_text_config(hf), family)
    if text.get("attn_output_gate", True) is not True:
        fail("attn_output_gate", text["attn_output_gate"], family, "Qwen3.5 attention is always output-gated")
    if moe:
        # no dense FFN anywhere: the expert width stands in for the (unused) dense one
        dense = text.get("intermediate_size") or text["moe_intermediate_size"]
        text = {**text, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}
        text["intermediate_size"] = dense
    else:
        text = {**text, "num_experts": 0}
    out = qwen3_next_from_hf(text, family)
    if not moe:
        out.pop("moe", None)
    return out


def _mrope_section(cfg: ModelConfig) -> list[int]:
    """The released models' 11:11:10 split of the rotary half-width (32 -> [11, 11, 10])."""
    head_dim = cfg.head_dim or cfg.dim // cfg.n_heads
    half = int(head_dim * cfg.position.rotary_fraction) // 2
    side = round(half * 11 / 32)
    return [side, side, half - 2 * side]


def _to_hf(cfg: ModelConfig, family: str, moe: bool) -> dict[str, Any]:
    if bool(cfg.moe.experts) != moe:
        other = "qwen3_5_moe_text" if cfg.moe.experts else "qwen3_5_text"
        raise HFConversionError(f"this model {'has' if cfg.moe.experts else 'has no'} MoE layers: export it as {other}")
    hf = qwen3_next_to_hf(cfg, family)
    # keys Qwen3.5's text configs do not have (the MoE model renormalizes its top-k in every layer)
    absent = ("decoder_sparse_step", "norm_topk_prob", "intermediate_size") if moe else ("num_experts",)
    for key in ("mlp_only_layers", *absent):
        hf.pop(key, None)
    hf["rope_parameters"] = {**hf["rope_parameters"], "mrope_section": _mrope_section(cfg), "mrope_interleaved": True}
    return {**hf, "attn_output_gate": True}


def _gdn_layers(cfg: ModelConfig) -> list[int]:
    return [i for i in range(cfg.n_layers) if layer_kind(cfg, i) == "D"]


def _prepare(hf: dict[str, Any], cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    """Released names (``model.language_model.``) and Qwen3.5's four projections -> Qwen3-Next's fused layout."""
    for key in [k for k in tensors if k.startswith(_LANGUAGE)]:
        tensors["model." + key[len(_LANGUAGE) :]] = tensors.pop(key)
    g = cfg.gdn
    hk, dk, dv, r = g.key_heads, g.key_head_dim, g.value_head_dim, g.value_heads // g.key_heads
    for i in _gdn_layers(cfg):
        p = f"model.layers.{i}.linear_attn."
        names = [f"{p}in_proj_{n}.weight" for n in ("qkv", "z", "b", "a")]
        if not all(n in tensors for n in names):
            continue  # the rules name what is missing
        qkv, z, b, a = (tensors.pop(n) for n in names)
        dim = qkv.shape[-1]
        q, k, v = qkv.split([hk * dk, hk * dk, g.value_heads * dv])
        parts = (q.view(hk, dk, dim), k.view(hk, dk, dim), v.view(hk, r * dv, dim), z.view(hk, r * dv, dim))
        tensors[f"{p}in_proj_qkvz.weight"] = torch.cat(parts, dim=1).reshape(-1, dim)
        tensors[f"{p}in_proj_ba.weight"] = torch.cat([b.view(hk, r, dim), a.view(hk, r, dim)], dim=1).reshape(-1, dim)


def _finish(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    """The inverse of :func:`_prepare`'s projection rewrite (export writes the text model's names)."""
    g = cfg.gdn
    hk, dk, dv, r = g.key_heads, g.key_head_dim, g.value_head_dim, g.value_heads // g.key_heads
    for i in _gdn_layers(cfg):
        p = f"model.layers.{i}.linear_attn."
        qkvz, ba = tensors.pop(f"{p}in_proj_qkvz.weight"), tensors.pop(f"{p}in_proj_ba.weight")
        dim = qkvz.shape[-1]
        q, k, v, z = (t.reshape(-1, dim) for t in qkvz.view(hk, -1, dim).split([dk, dk, r * dv, r * dv], dim=1))
        b, a = (t.reshape(-1, dim) for t in ba.view(hk, 2 * r, dim).split([r, r], dim=1))
        tensors[f"{p}in_proj_qkv.weight"] = torch.cat([q, k, v]).contiguous()
        for name, t in (("z", z), ("b", b), ("a", a)):
            tensors[f"{p}in_proj_{name}.weight"] = t.contiguous()


def _composite_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    raise HFConversionError(
        "tessera holds the text model only (no vision tower): export it as family qwen3_5_text or qwen3_5_moe_text"
    )


def _family(name: str, architecture: str, moe: bool, composite: bool = False) -> Family:
    return Family(
        name,
        architecture,
        lambda hf: _from_hf(hf, name, moe),
        _composite_to_hf if composite else (lambda cfg: _to_hf(cfg, name, moe)),
        qwen3_next_rules,
        QWEN3_NEXT_IGNORED + _VISION,
        prepare=_prepare,
        finish=_finish,
    )


# What an imported Qwen3.5 run exports as by default: its numbers are Qwen3-Next's, so detection alone cannot tell.
EXPORT_AS = {
    "qwen3_5": "qwen3_5_text",
    "qwen3_5_text": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
    "qwen3_5_moe_text": "qwen3_5_moe_text",
}

FAMILIES = {
    "qwen3_5_text": _family("qwen3_5_text", "Qwen3_5ForCausalLM", moe=False),
    "qwen3_5_moe_text": _family("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", moe=True),
    "qwen3_5": _family("qwen3_5", "Qwen3_5ForConditionalGeneration", moe=False, composite=True),
    "qwen3_5_moe": _family("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", moe=True, composite=True),
}
