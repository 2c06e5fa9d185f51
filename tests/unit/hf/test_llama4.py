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


def test_released_multimodal_checkpoint_imports_its_text_model(tmp_path):
    """A Llama4ForConditionalGeneration directory (as released: text_config, language_model.* tensors, a vision
    tower): tessera reads the text model, whose logits equal its HF language model's (1e-4); it exports as
    llama4_text, which HF reads back to the same logits; exporting it as the composite family is one line."""
    import tessera
    from tessera.hf.convert import hf_export, hf_import
    from tessera.hf.weights import save_hf

    text = dict(
        vocab_size=99, hidden_size=32, intermediate_size=16, intermediate_size_mlp=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128, num_local_experts=4,
        num_experts_per_tok=1, attention_chunk_size=8, floor_scale=4, attn_scale=0.5,
    )  # fmt: skip
    vision = dict(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, vision_output_dim=32,
        image_size=28, patch_size=14, projector_input_dim=32, projector_output_dim=32,
    )  # fmt: skip
    tokens = dict(image_token_index=98, boi_token_index=96, eoi_token_index=97)
    hf = transformers.Llama4ForConditionalGeneration(
        transformers.Llama4Config(text_config=text, vision_config=vision, **tokens)
    )
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(0.15 * torch.randn(p.shape, generator=gen))
    hf.eval().save_pretrained(tmp_path / "hf")
    x = torch.randint(4, 90, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf.language_model(input_ids=x).logits  # transformers 5.24's composite forward fails on text alone
        assert (tessera.load(tmp_path / "hf")(x) - ref).abs().max().item() <= 1e-4 and ref.std() > 0.1
    with pytest.raises(HFConversionError, match="export it as llama4_text"):
        save_hf(tessera.load(tmp_path / "hf"), tmp_path / "composite", "llama4")
    hf_import(tmp_path / "hf", tmp_path / "run")
    assert hf_export(tmp_path / "run", tmp_path / "out") == "llama4_text"
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back) is transformers.Llama4ForCausalLM
    with torch.no_grad():
        assert (back(x).logits - ref).abs().max().item() <= 1e-4
