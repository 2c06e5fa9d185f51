"""Llama 4 (text) interop details: the published Scout config and size, llama3 RoPE at Scout's equal frequency
factors, the q/k row order between HF's interleaved pairs and tessera's halves, and refusals.

The family's logits, greedy tokens and export round trip are in test_hf.py (``llama4``, ``llama4_maverick``);
its attention options against Llama4TextAttention in tests/unit/model/test_llama4_attention.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tessera.hf.families.llama4 import rope_pair_order
from tessera.hf.weights import HFConversionError, config_from_hf, export_config
from tessera.model import build_model, count_parameters
from tessera.model.position import RopeScaling, rope_inv_freq
from tessera.validate import load_config

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
SCOUT = 107_769_861_120
_SCOUT_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 16.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
}
# meta-llama/Llama-4-Scout-17B-16E's text_config (config.json), the keys that shape the model
SCOUT_TEXT = {
    "model_type": "llama4_text",
    "architectures": ["Llama4ForCausalLM"],
    "attention_bias": False,
    "attention_chunk_size": 8192,
    "attn_scale": 0.1,
    "attn_temperature_tuning": True,
    "floor_scale": 8192,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "interleave_moe_layer_step": 1,
    "intermediate_size": 8192,
    "intermediate_size_mlp": 16384,
    "max_position_embeddings": 10485760,
    "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(48)],
    "num_attention_heads": 40,
    "num_experts_per_tok": 1,
    "num_hidden_layers": 48,
    "num_key_value_heads": 8,
    "num_local_experts": 16,
    "rms_norm_eps": 1e-05,
    "rope_scaling": _SCOUT_ROPE,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "use_qk_norm": True,
    "vocab_size": 202048,
}


def test_scout_recipe_is_the_published_config_and_size():
    """The published text config imports to the recipe's model (but for the context length), the recipe exports to
    a config whose HF model (on meta) has as many parameters as ours and as the published one."""
    config = load_config(CONFIGS / "llama4-scout-17b-16e.toml")
    imported, family = config_from_hf(dict(SCOUT_TEXT))
    assert family == "llama4_text"
    for key in ("layer_pattern", "attention", "dim", "n_heads", "n_kv_heads", "head_dim", "ffn_hidden", "moe"):
        assert getattr(imported, key) == getattr(config.model, key), key
    assert imported.position.nope_layers == config.model.position.nope_layers
    hf_config, family = export_config(config.model)
    assert family == "llama4_text"
    text = {k: v for k, v in SCOUT_TEXT.items() if k not in ("model_type", "architectures", "rope_scaling")}
    with torch.device("meta"):
        hf = transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(**hf_config))
        published = transformers.Llama4ForCausalLM(
            transformers.Llama4TextConfig(**{**text, "rope_parameters": _SCOUT_ROPE})
        )
        ours = build_model(config.model)
    counts = [sum(p.numel() for p in m.parameters()) for m in (hf, published)]
    assert counts == [count_parameters(ours)] * 2 == [SCOUT] * 2


@pytest.mark.parametrize(("low", "high"), [(1.0, 1.0), (1.0, 4.0)])
def test_llama3_frequencies_equal_transformers(low, high):
    """Scout's equal low and high factors leave no blended band; tessera's frequencies are HF's there too."""
    rope = {**_SCOUT_ROPE, "low_freq_factor": low, "high_freq_factor": high}
    hf_cfg = transformers.Llama4TextConfig(head_dim=128, rope_parameters=rope)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg)
    got, _ = rope_inv_freq(128, 500000.0, RopeScaling("llama3", 16.0, 8192, low, high))
    assert torch.isfinite(got).all() and torch.allclose(got, want, rtol=1e-6, atol=0)


def test_rope_rows_go_from_pairs_to_halves_and_back():
    """Row 2j of a head rotates with row 2j + 1 in HF; they land at j and j + head/2 in tessera, and back."""
    rows = torch.arange(16)
    order = rope_pair_order(16, 8, inverse=False)
    assert order[:8].tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    assert torch.equal(rows[order][rope_pair_order(16, 8, inverse=True)], rows)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"moe_layers": [0, 2, 3]}, "moe_layers"),
        ({"layer_types": ["sliding_attention"] * 48}, "layer_types"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_configs_tessera_cannot_build_name_the_field(change, field):
    with pytest.raises(HFConversionError, match=field):
        config_from_hf({**SCOUT_TEXT, **change})


def test_a_chunk_as_long_as_the_context_is_full_attention():
    """attention_chunk_size >= max_position_embeddings: one chunk holds everything, imported as plain causal."""
    cfg, _ = config_from_hf({**SCOUT_TEXT, "max_position_embeddings": 8192, "rope_scaling": None})
    assert cfg.attention.chunk_size == 0 and cfg.layer_pattern == ""
