"""gpt-oss interop details: YaRN with truncate=false, the interleaved gate_up layout, the published sizes, refusals.

The family's logits, greedy tokens and export round trip are in test_hf.py (``gpt_oss``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tessera.hf.families.common import join_last, split_last
from tessera.hf.weights import HFConversionError, config_from_hf, export_config
from tessera.model import build_model, count_parameters
from tessera.model.position import RopeScaling, rope_inv_freq
from tessera.validate import load_config

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


@pytest.mark.parametrize("truncate", [False, True])
@pytest.mark.parametrize(
    ("head_dim", "theta", "factor", "original"), [(64, 150000.0, 32.0, 4096), (16, 150000.0, 4.0, 32)]
)
def test_yarn_frequencies_equal_transformers(truncate, head_dim, theta, factor, original):
    """tessera's YaRN inverse frequencies and cos/sin magnitude equal HF's ``_compute_yarn_parameters``
    (gpt-oss's published parameters and the tiny test model's), with and without truncation."""
    rope = {"rope_type": "yarn", "rope_theta": theta, "factor": factor, "beta_fast": 32.0, "beta_slow": 1.0}
    rope.update(truncate=truncate, original_max_position_embeddings=original)
    hf_cfg = transformers.GptOssConfig(head_dim=head_dim, rope_parameters=rope, max_position_embeddings=original * 32)
    want, want_scale = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
    got, scale = rope_inv_freq(head_dim, theta, RopeScaling("yarn", factor, original, truncate=truncate))
    assert torch.allclose(got, want, rtol=1e-6, atol=0) and scale == pytest.approx(want_scale)


@pytest.mark.parametrize(("head_dim", "factor", "original"), [(64, 32.0, 4096), (16, 4.0, 32)])
def test_truncation_changes_the_frequencies(head_dim, factor, original):
    """The two settings differ at gpt-oss's parameters and at test_hf.py's tiny model's (so parity tells them apart)."""
    plain, _ = rope_inv_freq(head_dim, 150000.0, RopeScaling("yarn", factor, original, truncate=True))
    kept, _ = rope_inv_freq(head_dim, 150000.0, RopeScaling("yarn", factor, original, truncate=False))
    assert ((plain - kept) / plain).abs().max() > 0.01


def test_interleaved_and_halves_layouts_invert():
    """gpt-oss's gate_up (gate on even channels) and Llama 4's (gate first) split and join back exactly."""
    gate, up = torch.randn(3, 5, 4), torch.randn(3, 5, 4)
    fused = join_last([gate, up], "interleaved")
    assert torch.equal(fused[..., ::2], gate) and torch.equal(fused[..., 1::2], up)
    assert torch.equal(split_last(fused, 1, 2, "interleaved"), up)
    halves = join_last([gate, up], "halves")
    assert torch.equal(halves[..., 4:], up) and torch.equal(split_last(halves, 0, 2, "halves"), gate)


@pytest.mark.parametrize("name", ["gpt-oss-20b", "gpt-oss-120b"])
def test_recipe_exports_to_the_published_size(name):
    """The recipe exports to an HF config equal to the published one in every field that sizes or shapes the
    model, and transformers' model of it (on meta) counts our parameters: 20.9B and 116.8B."""
    config = load_config(CONFIGS / f"{name}.toml")
    hf_config, family = export_config(config.model)
    assert family == "gpt_oss"
    layers = config.model.n_layers
    published = transformers.GptOssConfig(num_hidden_layers=layers, num_local_experts=config.model.moe.experts)
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
        assert hf_config[key] == getattr(published, key), key
    assert hf_config["layer_types"] == published.layer_types and hf_config["sliding_window"] == 128
    rope = {k: v for k, v in published.rope_parameters.items() if k != "rope_type"}
    assert {k: hf_config["rope_parameters"].get(k) for k in rope} == rope
    with torch.device("meta"):
        hf = transformers.GptOssForCausalLM(transformers.GptOssConfig(**hf_config))
        ours = build_model(config.model)
    assert sum(p.numel() for p in hf.parameters()) == count_parameters(ours)


def _hf_dict(**kw) -> dict:
    cfg = transformers.GptOssConfig(
        vocab_size=99, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4, **kw,
    )  # fmt: skip
    return json.loads(cfg.to_json_string())


def test_config_maps_alternating_layers_and_the_experts():
    cfg, family = config_from_hf(_hf_dict())
    assert family == "gpt_oss" and cfg.layer_pattern == "AG" and cfg.attention.sliding_window == 4
    assert cfg.attention.sinks and cfg.moe.router_bias and cfg.moe.expert_biases and cfg.moe.swiglu_limit == 7.0
    assert not cfg.position.rope_yarn_truncate and cfg.position.rope_theta == 150000.0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"swiglu_alpha": 1.5}, "swiglu_alpha=1.5"),
        ({"layer_types": ["chunked_attention", "full_attention"]}, "layer_types='chunked_attention'"),
    ],
)
def test_options_tessera_cannot_reproduce_are_refused(change, message):
    with pytest.raises(HFConversionError, match=message):
        config_from_hf({**_hf_dict(), **change})


def test_quantized_checkpoint_is_one_line():
    """OpenAI's own MXFP4 files: one line (an HFConversionError, which the CLI prints and exits 2 on) naming the
    quantization and how to get unquantized weights."""
    with pytest.raises(HFConversionError) as err:
        config_from_hf({**_hf_dict(), "quantization_config": {"quant_method": "mxfp4"}})
    assert "\n" not in str(err.value) and "mxfp4" in str(err.value) and "dequantize=True" in str(err.value)
