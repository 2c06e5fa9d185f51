"""Zoo components: attention kernels and masks, positions, FFNs, norms, architectures, KV caches."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tessera.config import ConfigError, ModelConfig, model_config
from tessera.validate import validate_model
from tessera.model import build_model, generate
from tessera.model.attention import linear_attention
from tessera.model.ffn import FeedForward, ffn_hidden_size
from tessera.model.masks import MaskSpec, attention_mask
from tessera.model.norm import RMSNorm
from tessera.model.position import (
    AbsolutePositions,
    RopeScaling,
    RotaryEmbedding,
    alibi_slopes,
    apply_rope,
    rope_inv_freq,
    signed_sin,
    sinusoidal_table,
)

V = 300


def _cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=V, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
    return model_config(**{**base, **kw})


def _model(**kw) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(_cfg(**kw)).eval()


def _tokens(b: int = 2, t: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(seed))


def test_packed_documents_match_separate_runs():
    model = _model()
    a, b = _tokens(1, 10, 1), _tokens(1, 6, 2)
    packed = torch.cat([a, b], dim=1)
    doc_ids = torch.tensor([[0] * 10 + [1] * 6])
    positions = torch.cat([torch.arange(10), torch.arange(6)])[None]
    with torch.no_grad():
        out = model(packed, positions=positions, document_ids=doc_ids)
        alone_a, alone_b = model(a), model(b)
        unmasked = model(packed)
    assert torch.allclose(out[:, :10], alone_a, atol=1e-5)
    assert torch.allclose(out[:, 10:], alone_b, atol=1e-5)
    assert not torch.allclose(unmasked[:, 10:], alone_b, atol=1e-3)  # without the mask, doc 2 sees doc 1


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(n_kv_heads=1),
        dict(sliding_window=5),
        dict(position="alibi"),
        dict(position="t5_bias"),
        dict(position="learned"),
        dict(position="sinusoidal"),
        dict(attention="longformer", sliding_window=4, global_tokens=2),
        dict(attention="bigbird", block_size=4, global_tokens=1, random_blocks=1),
        dict(rope_scaling="yarn", rope_scaling_factor=2.0, rotary_fraction=0.5, qk_norm=True),
    ],
)
def test_sdpa_equals_eager_and_kv_cache_equals_full_forward(kw):
    model = _model(**kw)
    x = _tokens()
    with torch.no_grad():
        full = model(x)
        if "attention" not in kw:
            eager = _model(attention="eager", **kw)
            assert torch.allclose(eager(x), full, atol=1e-5)
        caches = model.new_caches(2, 16)
        step = [model(x[:, :9], caches, 0)]
        step += [model(x[:, i : i + 1], caches, i) for i in range(9, 16)]
    assert torch.allclose(torch.cat(step, dim=1), full, atol=1e-5)


@pytest.mark.parametrize("kernel", ["linear", "performer"])
def test_linear_kernels_cache_and_causality(kernel):
    model = _model(attention=kernel)
    x = _tokens()
    y = x.clone()
    y[:, 10] = (y[:, 10] + 1) % V
    with torch.no_grad():
        full, changed = model(x), model(y)
        caches = model.new_caches(2, 16)
        step = [model(x[:, :10], caches, 0)] + [model(x[:, i : i + 1], caches, i) for i in range(10, 16)]
    assert torch.allclose(full[:, :10], changed[:, :10], atol=1e-6)  # the future does not leak back
    assert torch.allclose(torch.cat(step, dim=1), full, atol=1e-4)


def test_linear_attention_equals_explicit_quadratic_form():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.rand(1, 2, 7, 4, generator=g) for _ in range(3))
    sim = q @ k.transpose(-1, -2)
    causal = torch.ones(7, 7).tril()
    want = (sim * causal) @ v / (sim * causal).sum(-1, keepdim=True)
    assert torch.allclose(linear_attention(q, k, v, causal=True), want, atol=1e-5)
    assert torch.allclose(linear_attention(q, k, v, causal=False), sim @ v / sim.sum(-1, keepdim=True), atol=1e-5)


def test_performer_approximates_softmax_attention():
    from tessera.model.attention import PerformerFeatures

    torch.manual_seed(0)
    feats = PerformerFeatures(head_dim=8, n_features=4096)
    q, k, v = torch.randn(1, 1, 12, 8) * 0.5, torch.randn(1, 1, 12, 8) * 0.5, torch.randn(1, 1, 12, 8)
    exact = F.scaled_dot_product_attention(q, k, v)
    approx = linear_attention(feats(q, True), feats(k, False), v, causal=False)
    assert (approx - exact).abs().max() < 0.1


def test_longformer_and_bigbird_patterns():
    lf = attention_mask(MaskSpec("longformer", causal=False, window=2, global_tokens=1), 8, 8, torch.device("cpu"))[
        0, 0
    ]
    for q in range(8):
        for k in range(8):
            assert bool(lf[q, k]) == (abs(q - k) < 2 or q == 0 or k == 0)
    spec = MaskSpec("bigbird", causal=False, block_size=2, global_tokens=0, random_blocks=1, max_len=16)
    bb = attention_mask(spec, 16, 16, torch.device("cpu"))[0, 0]
    blocks = bb.view(8, 2, 8, 2)[:, 0, :, 0]  # one entry per (query block, key block)
    for qb in range(8):
        local = {kb for kb in range(8) if abs(qb - kb) <= 1}
        extra = {kb for kb in range(8) if bool(blocks[qb, kb])} - local
        assert local <= {kb for kb in range(8) if bool(blocks[qb, kb])} and len(extra) <= 1
    assert torch.equal(bb, attention_mask(spec, 16, 16, torch.device("cpu"))[0, 0])  # fixed random blocks


def test_sliding_window_mask_is_causal_and_bounded():
    m = attention_mask(MaskSpec("sdpa", causal=True, window=3), 6, 6, torch.device("cpu"))[0, 0]
    want = torch.tensor([[0 <= q - k < 3 for k in range(6)] for q in range(6)])
    assert torch.equal(m, want)
    assert attention_mask(MaskSpec("sdpa", causal=True), 6, 6, torch.device("cpu")) is None  # sdpa's is_causal path


def test_eager_hands_fp32_softmax_rows_to_an_observer_and_keeps_nothing():
    model = _model(attention="eager")
    seen = []
    model.layers["0"].attention.weights_observer = seen.append
    with torch.no_grad():
        model(_tokens())
    (w,) = seen
    assert not any(isinstance(v, torch.Tensor) for m in model.modules() for v in vars(m).values())
    assert w.dtype == torch.float32 and w.shape == (2, 4, 16, 16)
    assert torch.allclose(w.sum(-1), torch.ones(2, 4, 16))
    assert torch.equal(w.triu(1), torch.zeros_like(w))


def test_alibi_slopes_match_bloom():
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    for heads in (8, 6):
        bloom = build_alibi_tensor(torch.ones(1, 5), heads, torch.float32).view(heads, 5)
        assert torch.allclose(bloom[:, 1], alibi_slopes(heads))


def test_rope_scaling_and_partial_rotary():
    base, _ = rope_inv_freq(16, 10000.0)
    linear, _ = rope_inv_freq(16, 10000.0, RopeScaling("linear", 4.0))
    assert torch.allclose(linear, base / 4)
    ntk, _ = rope_inv_freq(16, 10000.0, RopeScaling("ntk", 4.0))
    assert torch.allclose(ntk, 1.0 / (10000.0 * 4.0 ** (16 / 14)) ** (torch.arange(0, 16, 2).float() / 16))
    _, magnitude = rope_inv_freq(16, 10000.0, RopeScaling("yarn", 4.0, 32))
    assert magnitude == pytest.approx(0.1 * math.log(4.0) + 1.0)
    x = torch.randn(1, 2, 5, 8)
    cos, sin = torch.randn(5, 4), torch.randn(5, 4)
    out = apply_rope(x, cos, sin)
    assert torch.equal(out[..., 4:], x[..., 4:])
    assert torch.allclose(out[..., :4], apply_rope(x[..., :4], cos, sin))


def test_rope_is_hf_rotate_half_to_the_bit():
    """apply_rope is HF Llama's rotate-half form to the bit (values and gradients, fp32), whatever the tables
    hold: a faster form of the rotation must keep these bits (the golden curves depend on them)."""
    from transformers.models.llama.modeling_llama import rotate_half

    torch.manual_seed(0)
    rope = RotaryEmbedding(16, 12, 10000.0)
    hf_sin = torch.cat([torch.outer(torch.arange(12.0), rope_inv_freq(16, 10000.0)[0])] * 2, dim=-1).sin()
    assert torch.equal(rope.sin, signed_sin(hf_sin))  # the table is HF's, signed
    tables = [(rope.cos[None, None], hf_sin[None, None]), (torch.randn(1, 1, 12, 16), torch.randn(1, 1, 12, 16))]
    for cos, sin in tables:
        x = torch.randn(2, 12, 3, 16).transpose(1, 2).requires_grad_()  # (B, H, T, D) as attention hands it
        ref = x.detach().clone().requires_grad_()
        ours, theirs = apply_rope(x, cos, signed_sin(sin)), ref * cos + rotate_half(ref) * sin
        assert torch.equal(ours, theirs)
        grad = torch.randn_like(ours)
        ours.backward(grad)
        theirs.backward(grad)
        assert torch.equal(x.grad, ref.grad)


def test_absolute_positions():
    table = sinusoidal_table(10, 6)
    assert table[3, 2] == pytest.approx(math.sin(3 / 10000 ** (2 / 6)))
    assert table[3, 3] == pytest.approx(math.cos(3 / 10000 ** (2 / 6)))
    learned = AbsolutePositions("learned", 8, 4)
    with pytest.raises(ValueError, match="max_seq_len=8"):
        learned(torch.arange(9))
    model = _model(position="learned")
    with pytest.raises(ValueError, match="max_seq_len"):
        model(_tokens(1, 65))


def test_norms_and_ffns():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = torch.randn(3, 8)
    ours, ref = RMSNorm(8, 1e-6), LlamaRMSNorm(8, eps=1e-6)
    ref.weight.data.copy_(torch.randn(8))
    ours.weight.data.copy_(ref.weight)
    assert torch.allclose(ours(x), ref(x), atol=1e-6)
    assert ffn_hidden_size(96, "swiglu", multiple_of=32) == 256  # 8/3 x, rounded up
    assert ffn_hidden_size(96, "gelu") == 384
    assert ffn_hidden_size(96, "gelu", hidden=100) == 100
    for act, fn in (("relu", F.relu), ("gelu", F.gelu), ("gelu_tanh", lambda h: F.gelu(h, approximate="tanh"))):
        ffn = FeedForward(8, 16, act, bias=True)
        assert torch.allclose(ffn(x), ffn.down_proj(fn(ffn.up_proj(x))))
    for act, fn in (("swiglu", F.silu), ("geglu", lambda h: F.gelu(h, approximate="tanh"))):
        ffn = FeedForward(8, 16, act)
        assert torch.allclose(ffn(x), ffn.down_proj(fn(ffn.gate_proj(x)) * ffn.up_proj(x)))


def test_qk_norm_makes_attention_scale_invariant():
    model = _model(qk_norm=True)
    x = _tokens()
    with torch.no_grad():
        before = model(x)
        for layer in model.layers.values():
            layer.attention.q_proj.weight.mul_(10.0)
            layer.attention.k_proj.weight.mul_(3.0)
        after = model(x)
    assert torch.allclose(before, after, atol=1e-4)


def test_init_tied_embeddings_and_dropout():
    model = build_model(_cfg(dim=256, n_heads=4, n_layers=8, tie_embeddings=True, dropout=0.1, init_std=0.02))
    assert model.output.weight is model.tok_embeddings.weight
    assert model.layers["0"].attention.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.layers["0"].attention.o_proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    x = _tokens(2, 8)
    model.train()
    assert not torch.equal(model(x), model(x))
    model.eval()
    assert torch.equal(model(x), model(x))


def test_encoder_is_bidirectional_and_decoder_causal():
    enc = _model(
        arch="encoder", position="learned", norm="layernorm", norm_position="post", type_vocab_size=2, embed_norm=True
    )
    s2s = _model(arch="encoder_decoder", position="t5_bias", attn_scale=1.0, n_decoder_layers=3)
    assert len(s2s.decoder.layers) == 3 and len(s2s.encoder.layers) == 2
    x, y = _tokens(1, 8), _tokens(1, 6, 1)
    x2, y2 = x.clone(), y.clone()
    x2[0, -1] = (x2[0, -1] + 1) % V
    y2[0, -1] = (y2[0, -1] + 1) % V
    with torch.no_grad():
        assert not torch.allclose(enc(x)[0, 0], enc(x2)[0, 0])  # the last token reaches the first
        assert torch.allclose(s2s(x, y)[0, :-1], s2s(x, y2)[0, :-1], atol=1e-6)  # decoder: no future
        assert not torch.allclose(s2s(x, y)[0, 0], s2s(x2, y)[0, 0])  # cross-attention sees all input


def test_generate_works_for_zoo_decoders():
    model = _model(position="alibi", sliding_window=4)
    out = generate(model, _tokens(1, 4), 6, temperature=0)
    assert out.shape == (1, 6)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["model.attention.kernel=linear", "model.position.kind=alibi"], "model.position"),
        (["model.attention.kernel=longformer"], "model.attention.sliding_window"),
        (["model.moe.experts=4", "model.moe.top_k=5"], "model.moe.top_k"),
        (["model.position.rotary_fraction=0.3"], "model.position.kind='rope'"),
        (["model.arch=encoder"], "model.sentinel_tokens"),
        (["model.objective=masked_lm"], "model.objective"),
    ],
)
def test_zoo_config_errors_name_the_key(overrides, key):
    from tessera.validate import load_config

    with pytest.raises(ConfigError, match=key.replace(".", r"\.").replace("(", r"\(")):
        load_config(None, overrides)


def test_head_dim_decoupled_from_dim():
    cfg = _cfg(head_dim=16, dim=40, n_heads=4, n_kv_heads=4)
    validate_model(cfg)
    model = build_model(cfg)
    assert model.layers["0"].attention.q_proj.weight.shape == (64, 40)
    assert model(_tokens()).shape == (2, 16, V)
    with pytest.raises(ConfigError, match="model.head_dim"):
        validate_model(_cfg(dim=40, n_heads=3, n_kv_heads=3))
