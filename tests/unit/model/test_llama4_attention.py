"""Llama 4's attention options against transformers' Llama4TextAttention (fp32, outputs and gradients, 1e-5):
chunked attention and the QK L2 norm on a RoPE layer, temperature tuning on a NoPE layer; each option, taken
away, changes the output; bad configs are one line naming the field; context parallelism is refused."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import masking_utils
from transformers.models.llama4 import modeling_llama4 as hf_llama4

from tessera.config import ConfigError, model_config, read_config
from tessera.hf.families.llama4 import rope_pair_order
from tessera.hf.weights import config_from_hf
from tessera.layout import check_layout
from tessera.model.attention import MIXER, AttnContext
from tessera.model.masks import MaskSpec, attention_mask, block_layout
from tessera.model.position import RotaryEmbedding, rope_scaling_of
from tessera.validate import validate_model

T, CHUNK, HEAD = 20, 8, 8
ROPE_LAYER, NOPE_LAYER = 0, 3  # no_rope_layer_interval 4: layer 3 has no rotary
_LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def _hf_config() -> transformers.Llama4TextConfig:
    cfg = transformers.Llama4TextConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD, num_hidden_layers=4,
        intermediate_size=16, intermediate_size_mlp=48, num_local_experts=4, max_position_embeddings=64,
        attention_chunk_size=CHUNK, floor_scale=4, attn_scale=0.5, rope_parameters=_LLAMA3,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    return cfg


def _pair(layer: int) -> tuple[torch.nn.Module, torch.nn.Module, object]:
    """HF's attention of ``layer`` and ours with the same weights (q/k rows de-interleaved on RoPE layers)."""
    hf_cfg = _hf_config()
    torch.manual_seed(0)
    hf = hf_llama4.Llama4TextAttention(hf_cfg, layer)
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.3)
    cfg, _ = config_from_hf({**hf_cfg.to_dict(), "vocab_size": 99})
    ours = MIXER.build(cfg, layer)
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            w = getattr(hf, name).weight
            rope = name in ("q_proj", "k_proj") and layer != NOPE_LAYER
            getattr(ours, name).weight.copy_(w[rope_pair_order(w.shape[0], HEAD, False)] if rope else w)
    return hf, ours, cfg


def _hf_forward(hf: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    cfg, positions = hf.config, torch.arange(x.shape[1])[None]
    make = masking_utils.create_chunked_causal_mask if hf.use_rope else masking_utils.create_causal_mask
    mask = make(config=cfg, inputs_embeds=x, attention_mask=None, cache=None, position_ids=positions)
    freqs = hf_llama4.Llama4TextRotaryEmbedding(cfg)(x, positions)
    return hf(x, position_embeddings=freqs, attention_mask=mask)[0]


def _context(cfg, layer: int, chunk: int = CHUNK) -> AttnContext:
    if layer == NOPE_LAYER:
        return AttnContext(is_causal=True, causal=True)
    rope = RotaryEmbedding(HEAD, cfg.max_seq_len, cfg.position.rope_theta, rope_scaling_of(cfg.position, 64))
    cos, sin = rope(0, T)
    mask = attention_mask(MaskSpec(chunk=chunk, max_len=cfg.max_seq_len), T, T, torch.device("cpu"))
    return AttnContext(mask=mask, cos=cos, sin=sin, causal=True)


def _run(module, x, ctx=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Output, input gradient and v_proj's weight gradient (HF's module runs through :func:`_hf_forward`)."""
    x = x.clone().requires_grad_(True)
    out = _hf_forward(module, x) if ctx is None else module(x, ctx)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), x.grad, module.v_proj.weight.grad


def _x() -> torch.Tensor:
    return torch.randn(2, T, 32, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("layer", [ROPE_LAYER, NOPE_LAYER], ids=["rope_chunked_l2", "nope_temperature"])
def test_attention_layer_equals_transformers(layer):
    hf, ours, cfg = _pair(layer)
    assert (ours.qk_l2_eps > 0, ours.temperature is not None) == (layer == ROPE_LAYER, layer == NOPE_LAYER)
    want = _run(hf, _x())
    got = _run(ours, _x(), _context(cfg, layer))
    assert want[0].std() > 0.1
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a - b).abs().max()


def _differs(ours, cfg, layer: int, chunk: int = CHUNK) -> float:
    hf_out = _hf_forward(_pair(layer)[0], _x()).detach()
    with torch.no_grad():
        return (ours(_x(), _context(cfg, layer, chunk)) - hf_out).abs().max().item()


def test_each_option_matters():
    """Without chunks, without the L2 norm, without the temperature: each output differs from HF's."""
    _, ours, cfg = _pair(ROPE_LAYER)
    assert _differs(ours, cfg, ROPE_LAYER, chunk=0) > 1e-2
    ours.qk_l2_eps = 0.0
    assert _differs(ours, cfg, ROPE_LAYER) > 1e-2
    _, ours, cfg = _pair(NOPE_LAYER)
    ours.temperature = None
    assert _differs(ours, cfg, NOPE_LAYER) > 1e-2


def test_chunk_mask_is_hfs_at_every_position():
    """The boolean chunk rule against HF's mask function, decoding rows included (a query at a chunk's start
    sees only itself)."""
    hf_rule = masking_utils.chunked_causal_mask_function(CHUNK, torch.zeros(1, dtype=torch.long))
    q, k = torch.arange(T)[:, None], torch.arange(T)[None]
    want = hf_rule(0, 0, q, k)
    got = attention_mask(MaskSpec(chunk=CHUNK), T, T, torch.device("cpu"))[0, 0]
    assert torch.equal(got, want)
    assert torch.equal(attention_mask(MaskSpec(chunk=CHUNK), 1, T, torch.device("cpu"))[0, 0, 0], want[-1])


@pytest.mark.parametrize(("chunk", "length"), [(8, 40), (256, 600), (200, 520)])
def test_block_sparse_plan_is_the_dense_chunk_mask(chunk, length):
    """The block-sparse plan of whole sequences allows exactly the dense mask's keys (blocks tiling the chunks,
    and not), and scores fewer keys than dense attention."""
    spec = MaskSpec(chunk=chunk)
    plan = block_layout(spec, length, torch.device("cpu"))
    assert plan is not None and plan.keys_per_query < length
    blocks, size = plan.n_blocks, plan.block
    q = torch.arange(blocks * size).view(blocks, size, 1)
    k = (plan.key_blocks[:, :, None] * size + torch.arange(size)).view(blocks, 1, -1).expand(-1, size, -1)
    seen = torch.zeros(blocks * size, blocks * size + size, dtype=torch.bool)
    rows = q.expand_as(k)[plan.mask[0]]
    seen[rows, k[plan.mask[0]]] = True
    want = attention_mask(spec, length, length, torch.device("cpu"))[0, 0]
    assert torch.equal(seen[:length, :length], want)


def test_a_sequence_within_one_chunk_needs_no_mask():
    """Up to the first boundary chunks change nothing: plain causal attention (sdpa's fast path), no mask tensor."""
    cpu = torch.device("cpu")
    assert attention_mask(MaskSpec(chunk=CHUNK), CHUNK, CHUNK, cpu) is None
    assert attention_mask(MaskSpec(chunk=CHUNK), 1, CHUNK, cpu) is None
    assert attention_mask(MaskSpec(chunk=CHUNK), 1, CHUNK + 1, cpu) is not None


def test_left_padded_generation_is_refused():
    """HF counts chunks from each row's first real token: tessera refuses left-padded batches in one line."""
    from tessera.model import build_model, generate

    model = build_model(read_config("configs/tiny/llama4.toml").model).eval()
    with pytest.raises(ValueError, match="left padding with chunked attention"):
        generate(model, [[5, 6, 7], [8, 9]], 2, temperature=0)


_BASE = dict(dim=32, n_heads=4, n_layers=4, max_seq_len=64, layer_pattern="AAAG")


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"attention": {"chunk_size": 64}}, "chunk_size=64 is not smaller than the context"),
        ({"attention": {"chunk_size": -8}}, "chunk_size must be positive"),
        ({"attention": {"chunk_size": 8, "sliding_window": 4}}, "without model.attention.sliding_window"),
        ({"attention": {"chunk_size": 8, "temperature_tuning": True}}, "set model.position.nope_layers"),
        (
            {"attention": {"chunk_size": 8, "temperature_tuning": True, "temperature_floor": 0}},
            "temperature_floor must be positive",
        ),
        ({"attention": {"chunk_size": 8, "qk_l2_norm": True, "qk_norm": True}}, "without model.attention.qk_norm"),
    ],
)
def test_bad_configs_are_one_line(keys, message):
    with pytest.raises(ConfigError, match=message):
        validate_model(model_config(**_BASE, **keys))


@pytest.mark.parametrize("option", ["chunk_size=16", "qk_l2_norm=true", "temperature_tuning=true"])  # one at a time
def test_context_parallelism_is_refused_naming_the_option(option):
    """cp is refused in one line; tp and pp pass (their parity: tests/integration/test_llama4_parallel.py)."""
    off = ["model.attention.chunk_size=0", "model.layer_pattern=", "model.attention.qk_l2_norm=false"]
    off += ["model.attention.temperature_tuning=false"]
    name = option.split("=")[0]
    for layout in ("tp", "pp"):
        check_layout(
            read_config("configs/tiny/llama4.toml", [*off, f"model.attention.{option}", f"parallel.{layout}=2"])
        )
    job = read_config("configs/tiny/llama4.toml", [*off, f"model.attention.{option}", "parallel.cp=2"])
    with pytest.raises(ConfigError, match=rf"{name} without parallel\.cp"):
        check_layout(job, 2)
