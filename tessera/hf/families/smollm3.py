"""SmolLM3 (HF ``SmolLM3ForCausalLM``): a Llama whose every 4th layer has no rotary (NoPE, ``no_rope_layers``)."""

from __future__ import annotations

from typing import Any

from tessera.config import ModelConfig
from tessera.hf.families.common import Family, fail
from tessera.hf.families.llama import llama_from_hf, llama_rules, llama_to_hf
from tessera.model.layer_patterns import nope_layers

FAMILY = "smollm3"


def smollm3_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig keys of an HF SmolLM3 config."""
    if hf.get("use_sliding_window"):  # HF slides the NoPE layers only: no tessera pattern says that yet
        fail("use_sliding_window", True, FAMILY)
    n = hf["num_hidden_layers"]
    interval = int(hf.get("no_rope_layer_interval") or 4)
    uses_rope = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
    out = llama_from_hf({**hf, "tie_word_embeddings": hf.get("tie_word_embeddings", True)}, FAMILY)
    bias = bool(hf.get("attention_bias", False))
    out["attention"].update(qkv_bias=bias, o_bias=bias)
    out["position"]["nope_layers"] = ",".join(str(i) for i, rope in enumerate(uses_rope) if not rope)
    return out


def smollm3_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The HF SmolLM3 config of a tessera config (exactness is checked by the caller)."""
    nope = nope_layers(cfg)
    return {
        **llama_to_hf(cfg, "llama"),
        "no_rope_layers": [0 if i in nope else 1 for i in range(cfg.n_layers)],
        "use_sliding_window": False,
        "sliding_window": None,
        # HF's default pad id (128004) is SmolLM3's tokenizer's: a smaller vocabulary cannot hold it
        "pad_token_id": 128004 if cfg.vocab_size > 128004 else None,
    }


FAMILIES = {FAMILY: Family(FAMILY, "SmolLM3ForCausalLM", smollm3_from_hf, smollm3_to_hf, llama_rules, ("rotary_emb",))}
