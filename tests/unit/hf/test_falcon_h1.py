"""Falcon-H1 (FalconH1ForCausalLM) against transformers, built from tiny configs (fp32): logits within 1e-4, 20
greedy tokens with the decoding cache identical, export and re-import; one decoder layer against HF's
FalconH1DecoderLayer (outputs and gradients); every multiplier shown to matter; refused configs name the field."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
import transformers
from transformers.models.falcon_h1 import modeling_falcon_h1 as hf_fh

import tessera
from tessera.config import ConfigError, model_config
from tessera.hf.weights import HFConversionError, config_from_hf, save_hf
from tessera.model import build_model, generate
from tessera.validate import validate_model

from helpers.runs import run_cli

V, TOL = 96, 1e-4
# Every multiplier away from 1 (and from each other), so that dropping any one changes the numbers.
MULTIPLIERS = dict(
    embedding_multiplier=2.0,
    lm_head_multiplier=0.5,
    mlp_multipliers=[1.5, 0.6],
    key_multiplier=0.7,
    attention_in_multiplier=1.3,
    attention_out_multiplier=0.8,
    ssm_multipliers=[0.9, 1.1, 0.8, 1.2, 1.3],
    ssm_in_multiplier=1.2,
    ssm_out_multiplier=0.6,
)


def _config(**kw) -> transformers.FalconH1Config:
    """2 layers of dim 32: attention 4 heads of 8 (GQA 2), Mamba-2 6 heads of 8 (inner 48 = 1.5 x dim) in 2 groups."""
    args = dict(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        mamba_d_ssm=48,
        mamba_n_heads=6,
        mamba_d_head=8,
        mamba_n_groups=2,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_chunk_size=8,
        max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        attn_implementation="sdpa",
        **MULTIPLIERS,
    )
    return transformers.FalconH1Config(**{**args, **kw})


VARIANTS = {
    # the gated RMSNorm after the gate (the released 7B's order) and before it (HF's default)
    "gated_norm": dict(mamba_rms_norm=True, mamba_norm_before_gate=False),
    "norm_before_gate": dict(mamba_rms_norm=True, mamba_norm_before_gate=True),
    # no norm (y * silu(z), the 0.5B's), every bias, tied embeddings, mamba_d_ssm = expand * dim, one group
    "plain_biases_tied": dict(
        mamba_rms_norm=False,
        attention_bias=True,
        mlp_bias=True,
        projectors_bias=True,
        mamba_proj_bias=True,
        tie_word_embeddings=True,
        mamba_d_ssm=64,
        mamba_n_heads=8,
        mamba_n_groups=1,
    ),
}


def _randomize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights far from HF's nearly flat init; decays and time steps spread so the state carries information."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("A_log"):
                p.copy_(2 * torch.rand(p.shape, generator=gen))
            elif name.endswith("dt_bias"):
                p.copy_(noise - 2)
            elif p.ndim == 1 and "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * noise)
            else:
                p.copy_(0.15 * noise)
    return module.eval()


def _tokens() -> torch.Tensor:
    return torch.randint(4, V, (2, 24), generator=torch.Generator().manual_seed(2))


def _pair(variant: str, tmp_path) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    hf = _randomize(transformers.FalconH1ForCausalLM(_config(**VARIANTS[variant])), seed=1)
    hf.save_pretrained(tmp_path / "hf")
    return hf, tessera.load(tmp_path / "hf")


def _diff(model: torch.nn.Module, ref: torch.Tensor, x: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x) - ref).abs().max().item()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_falcon_h1_logits_generation_and_export_match_transformers(variant, tmp_path):
    hf, model = _pair(variant, tmp_path)
    x = _tokens()
    with torch.no_grad():
        ref = hf(x).logits
    assert _diff(model, ref, x) <= TOL
    assert ref.std() > 0.1  # not a comparison of near-constant logits
    hf.generation_config.eos_token_id = None
    want = hf.generate(x[:, :8], max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)[:, 8:]
    assert torch.equal(generate(model, x[:, :8], 20, temperature=0), want)  # both with their decoding caches

    save_hf(model, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back) is transformers.FalconH1ForCausalLM
    with torch.no_grad():
        assert (back(x).logits - ref).abs().max().item() <= TOL


def test_decoding_with_the_hybrid_cache_equals_recomputation(tmp_path):
    """A prompt, then one token at a time through the KV + SSM caches: the logits of the full forward."""
    _, model = _pair("gated_norm", tmp_path)
    x = _tokens()
    with torch.no_grad():
        full = model(x)
        caches = model.new_caches(2, 24)
        steps = [model(x[:, :8], caches, 0)]
        steps += [model(x[:, t : t + 1], caches, t) for t in range(8, 24)]
    assert (torch.cat(steps, dim=1) - full).abs().max().item() <= 1e-5


def _breaks(model: torch.nn.Module) -> dict[str, callable]:
    """Each multiplier of the tessera model set back to 1, one at a time (what dropping it in the code would do)."""
    blocks = list(model.layers.values())

    def each(fn):
        return lambda: [fn(block) for block in blocks]

    def ssm(i: int):
        def drop(block):
            proj = block.hybrid.mamba.in_proj
            proj.scale_out = tuple(1.0 if j == i else s for j, s in enumerate(proj.scale_out))

        return each(drop)

    return {
        "embedding_multiplier": lambda: setattr(model.tok_embeddings, "multiplier", 1.0),
        "lm_head_multiplier": lambda: setattr(model.cfg.mup, "head", 1.0),
        "mlp gate": each(lambda b: setattr(b.feed_forward, "gate_multiplier", 1.0)),
        "mlp down": each(lambda b: setattr(b.feed_forward, "down_multiplier", 1.0)),
        "key_multiplier": each(lambda b: setattr(b.hybrid.attention.k_proj, "scale_out", (1.0,))),
        "attention_in_multiplier": each(lambda b: setattr(b.hybrid, "attention_in", 1.0)),
        "attention_out_multiplier": each(lambda b: setattr(b.hybrid, "attention_out", 1.0)),
        "ssm_in_multiplier": each(lambda b: setattr(b.hybrid.mamba.in_proj, "scale_in", 1.0)),
        "ssm_out_multiplier": each(lambda b: setattr(b.hybrid, "ssm_out", 1.0)),
        **{f"ssm_multipliers[{i}] ({part})": ssm(i) for i, part in enumerate("zxBCd")},
    }


def test_every_multiplier_changes_the_logits(tmp_path):
    """Dropping any one multiplier moves the logits far past the parity tolerance: the parity test catches it."""
    hf, model = _pair("gated_norm", tmp_path)
    x = _tokens()
    with torch.no_grad():
        ref = hf(x).logits
    for name in _breaks(model):
        broken = tessera.load(tmp_path / "hf")
        _breaks(broken)[name]()
        assert _diff(broken, ref, x) > 100 * TOL, f"dropping {name} went unnoticed"


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    scale = b.abs().max().clamp_min(1.0)
    assert (a - b).abs().max().item() <= 1e-5 * scale, f"max diff {(a - b).abs().max().item():.2e}"


_LAYER_NAMES = {
    "input_layernorm.": "hybrid_norm.",
    "self_attn.": "hybrid.attention.",
    "mamba.": "hybrid.mamba.",
    "pre_ff_layernorm.": "ffn_norm.",
    "feed_forward.": "feed_forward.",
}


def _layers() -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module, torch.nn.Module]:
    """HF's decoder layer (its mup_vector as FalconH1Model registers it), ours (loaded from it), HF's rotary
    embedding and a one-layer tessera model that builds the attention context."""
    cfg = _config(mamba_rms_norm=True, mamba_norm_before_gate=False)
    hf = hf_fh.FalconH1DecoderLayer(cfg, layer_idx=0)
    hf.mamba.register_buffer("mup_vector", hf_fh.compute_mup_vector(cfg), persistent=False)
    _randomize(hf, seed=3)
    hf_cfg = json.loads(cfg.to_json_string())
    model = build_model(config_from_hf({**hf_cfg, "num_hidden_layers": 1})[0]).eval()
    ours = model.layers["0"]
    state = {}
    for key, value in hf.state_dict().items():
        prefix = next(p for p in _LAYER_NAMES if key.startswith(p))
        state[_LAYER_NAMES[prefix] + key[len(prefix) :]] = value
    ours.load_state_dict(state)
    return hf, ours, hf_fh.FalconH1RotaryEmbedding(cfg), model


def test_parallel_hybrid_layer_matches_falcon_h1_decoder_layer_outputs_and_grads():
    hf, ours, rotary, model = _layers()
    x = torch.randn(2, 21, 32, generator=torch.Generator().manual_seed(4))  # 21: a partial last chunk
    positions = torch.arange(21)[None]

    def run(layer, fn):
        h = x.clone().requires_grad_()
        out = fn(layer, h)
        out.pow(2).sum().backward()
        return out, h.grad, {n: p.grad for n, p in layer.named_parameters()}

    want, want_dx, want_dw = run(
        hf, lambda l, h: l(h, position_ids=positions, position_embeddings=rotary(h, positions))[0]
    )
    got, got_dx, got_dw = run(ours, lambda l, h: l(h, model.context(2, 21, 0, None, None, h.device)))
    _close(got, want)
    _close(got_dx, want_dx)
    for name, grad in want_dw.items():
        prefix = next(p for p in _LAYER_NAMES if name.startswith(p))
        _close(got_dw[_LAYER_NAMES[prefix] + name[len(prefix) :]], grad)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"mamba_d_head": 7}, "mamba_d_head"),  # 7 x 6 heads is not mamba_d_ssm = 48
        ({"mamba_n_groups": 4}, "mamba_n_groups"),  # 6 heads do not split into 4 groups
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"time_step_limit": [0.01, math.inf]}, "time_step_limit"),
        ({"projectors_bias": True}, "projectors_bias"),  # but mamba_proj_bias false
        ({"attn_layer_indices": [0]}, "attn_layer_indices"),
        ({"ssm_multipliers": [1.0, 1.0]}, "ssm_multipliers"),
    ],
)
def test_falcon_h1_configs_tessera_cannot_build_name_the_field(change, field):
    hf = json.loads(_config().to_json_string())
    with pytest.raises(HFConversionError, match=re.escape(field)):
        config_from_hf({**hf, **change})


def test_cli_falcon_h1_mamba_dims_that_disagree_are_one_line(tmp_path):
    transformers.FalconH1ForCausalLM(_config()).save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "mamba_d_head": 7}))
    res = run_cli("convert", "hf-import", str(tmp_path / "hf"), str(tmp_path / "run"))
    assert res.returncode == 2
    assert "mamba_d_head" in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


_HYBRID = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, layer_pattern="H")


@pytest.mark.parametrize(
    "overrides, field",
    [
        (
            {"mamba": {"version": 2, "head_dim": 8, "groups": 2}, "hybrid": {"mamba_inner": 40}},
            "model.hybrid.mamba_inner",
        ),
        ({"mamba": {"version": 1}}, "model.mamba.version"),
        ({"mamba": {"version": 2, "head_dim": 8}, "hybrid": {"key": math.inf}}, "model.hybrid.key"),
        ({"mamba": {"version": 2, "head_dim": 8}, "mup": {"head": 0.0}}, "model.mup.head"),
        (
            {"mamba": {"version": 2, "head_dim": 8}, "mup": {"head": 0.5}, "norm_position": "post"},
            "model.mup.head scales the final norm's output, which model.norm_position='post'",
        ),
    ],
)
def test_hybrid_config_errors_name_the_key(overrides, field):
    with pytest.raises(ConfigError, match=re.escape(field)):
        validate_model(model_config(**_HYBRID, **overrides))


def test_falcon_h1_7b_recipe_exports_to_the_published_size():
    """The full-size recipe's exported config builds (on meta) an HF FalconH1ForCausalLM with as many parameters as
    tessera's model of the recipe: 7,585,648,736 (Falcon-H1-7B-Base's 7.59B)."""
    from pathlib import Path

    from tessera.hf.weights import export_config
    from tessera.model import count_parameters
    from tessera.validate import load_config

    config = load_config(Path(__file__).resolve().parents[3] / "configs" / "falcon-h1-7b.toml")
    hf_config, family = export_config(config.model)
    assert family == "falcon_h1" and hf_config["mamba_d_ssm"] == 3072 and hf_config["mamba_rms_norm"]
    with torch.device("meta"):
        hf = transformers.FalconH1ForCausalLM(transformers.FalconH1Config(**hf_config))
        ours = build_model(config.model)
    assert sum(p.numel() for p in hf.parameters()) == count_parameters(ours) == 7_585_648_736
