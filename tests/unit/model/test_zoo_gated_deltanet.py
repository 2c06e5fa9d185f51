"""Gated DeltaNet: the mixer against HF's Qwen3NextGatedDeltaNet (outputs and gradients, fp32 1e-5), the chunked
form against the recurrent one on every position, decoding with the state cache against full recomputation, and
packed documents against each document alone."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.qwen3_next import modeling_qwen3_next as hf_next

from tessera.config import model_config
from tessera.model.gated_deltanet import (
    GatedDeltaNet,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from tessera.model.attention import Attention, AttnContext
from tessera.model.norm import ZeroCenteredRMSNorm
from tessera.model.recurrent import causal_depthwise_conv
from tessera.model.position import RotaryEmbedding

from helpers.splits import InOrderSplit

TOL = 1e-5
_GDN = dict(key_heads=2, value_heads=4, key_head_dim=8, value_head_dim=6, conv=4, chunk=8)


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = TOL) -> None:
    scale = b.abs().max().clamp_min(1.0)
    assert (a - b).abs().max().item() <= tol * scale, f"max diff {(a - b).abs().max().item():.2e}"


def _pair(seed: int = 0) -> tuple[torch.nn.Module, GatedDeltaNet]:
    """HF's layer with spread-out random weights and ours loaded from its state dict."""
    hfc = transformers.Qwen3NextConfig(
        hidden_size=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=6,
        linear_conv_kernel_dim=4,
        num_hidden_layers=1,
        rms_norm_eps=1e-6,
    )
    hf = hf_next.Qwen3NextGatedDeltaNet(hfc, 0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(2 * torch.rand(p.shape, generator=gen) if name == "A_log" else 0.3 * noise)
    ours = GatedDeltaNet(model_config(dim=32, norm_eps=1e-6, gdn=_GDN))
    ours.load_state_dict(hf.state_dict())
    return hf, ours


def test_mixer_matches_hf_outputs_and_gradients():
    hf, ours = _pair()
    x = torch.randn(2, 21, 32, generator=torch.Generator().manual_seed(1))  # 21: a partial last chunk
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = hf(xa), ours(xb)
    _close(got, want)
    assert want.std() > 0.1
    grad = torch.randn_like(want)
    want.backward(grad)
    got.backward(grad)
    _close(xb.grad, xa.grad)
    theirs = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        _close(p.grad, theirs[name].grad)


def _rule_inputs(b=2, h=3, t=37, dk=8, dv=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(b, h, t, dk, generator=gen), dim=-1) * dk**-0.5
    k = torch.nn.functional.normalize(torch.randn(b, h, t, dk, generator=gen), dim=-1)
    v = torch.randn(b, h, t, dv, generator=gen)
    g = -torch.rand(b, h, t, generator=gen)
    beta = torch.rand(b, h, t, generator=gen)
    state = torch.randn(b, h, dk, dv, generator=gen)
    return q, k, v, g, beta, state


def test_kernels_match_hf_kernels():
    """Our chunked and recurrent forms against HF's torch_chunk/recurrent_gated_delta_rule (HF takes (B, T, H, D)
    and scales q itself)."""
    q, k, v, g, beta, state = _rule_inputs()
    dk = q.shape[-1]
    args = [t.transpose(1, 2) for t in (q * dk**0.5, k, v, g, beta)]
    want, want_state = hf_next.torch_chunk_gated_delta_rule(
        *args[:3], g=args[3], beta=args[4], chunk_size=8, initial_state=state, output_final_state=True
    )
    got, got_state = chunk_gated_delta_rule(q, k, v, g, beta, 8, state)
    _close(got.transpose(1, 2), want)
    _close(got_state, want_state)
    want, want_state = hf_next.torch_recurrent_gated_delta_rule(
        *args[:3], g=args[3], beta=args[4], initial_state=state, output_final_state=True
    )
    got, got_state = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    _close(got.transpose(1, 2), want)
    _close(got_state, want_state)


@pytest.mark.parametrize("chunk", [1, 4, 16, 64])
def test_chunked_equals_recurrent_on_every_position(chunk):
    q, k, v, g, beta, state = _rule_inputs()
    docs = torch.tensor([[0] * 10 + [1] * 20 + [2] * 7, [0] * 3 + [1] * 34])
    for d in (None, docs):
        rec, rec_state = recurrent_gated_delta_rule(q, k, v, g, beta, state, d)
        out, out_state = chunk_gated_delta_rule(q, k, v, g, beta, chunk, state, d)
        _close(out, rec)
        _close(out_state, rec_state)


def test_decoding_with_the_state_cache_equals_recomputation():
    _, ours = _pair()
    x = torch.randn(2, 19, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = ours(x)
        cache = ours.new_cache(2, x.device)
        parts = [ours(x[:, :11], cache, 0)]  # a prefill (chunked, partial chunk), then one token at a time
        parts += [ours(x[:, t : t + 1], cache, t) for t in range(11, 19)]
    _close(torch.cat(parts, dim=1), full)
    assert cache.bytes() == 2 * (ours.conv_dim * 3 + 4 * 8 * 6) * 4  # fixed, whatever the length


def test_packed_documents_equal_each_document_alone():
    _, ours = _pair()
    lengths = [5, 13, 1, 11]
    x = torch.randn(1, sum(lengths), 32, generator=torch.Generator().manual_seed(4))
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    with torch.no_grad():
        packed = ours(x, document_ids=docs)
        alone = torch.cat([ours(part) for part in x.split(lengths, dim=1)], dim=1)
        assert (ours(x) - alone).abs().max() > 1e-3  # without the ids the state crosses the boundaries
    _close(packed, alone)


def test_document_conv_restarts_the_window():
    x = torch.randn(1, 3, 9)
    weight = torch.randn(3, 1, 4)
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 2]])
    got = causal_depthwise_conv(x, weight, docs)
    want = torch.cat([causal_depthwise_conv(x[..., s:e], weight, None) for s, e in ((0, 3), (3, 8), (8, 9))], -1)
    _close(got, want)


def test_zero_centered_rmsnorm_matches_hf():
    norm = hf_next.Qwen3NextRMSNorm(32, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    ours = ZeroCenteredRMSNorm(32, 1e-6)
    ours.load_state_dict(norm.state_dict())
    x = torch.randn(3, 32)
    _close(ours(x), norm(x))
    assert torch.equal(ZeroCenteredRMSNorm(4).weight, torch.zeros(4))  # a unit gain at initialization


def test_gated_attention_with_partial_rotary_matches_hf():
    """Qwen3NextAttention: a sigmoid output gate from q_proj, zero-centred per-head QK-norm, a quarter of each head
    rotated; outputs and gradients."""
    hfc = transformers.Qwen3NextConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=1
    )
    hfc._attn_implementation = "eager"
    hf = hf_next.Qwen3NextAttention(hfc, 0)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    cfg = model_config(
        dim=32,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        norm="zero_centered_rmsnorm",
        norm_eps=1e-6,
        max_seq_len=64,
        attention=dict(qk_norm=True, output_gate=True, kernel="eager"),
        position=dict(rotary_fraction=0.25),
    )
    ours = Attention(cfg)
    ours.load_state_dict(hf.state_dict())
    rope = RotaryEmbedding(16, 64, hfc.rope_parameters["rope_theta"], fraction=0.25)
    x = torch.randn(2, 12, 32, generator=gen)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    cos, sin = hf_next.Qwen3NextRotaryEmbedding(hfc)(x, torch.arange(12)[None])
    mask = torch.full((12, 12), float("-inf")).triu(1)[None, None]
    want, _ = hf(xa, (cos, sin), mask)
    ctx_cos, ctx_sin = rope(0, 12)
    got = ours(xb, AttnContext(is_causal=True, causal=True, cos=ctx_cos, sin=ctx_sin))
    _close(got, want)
    assert cos.shape[-1] == 4 and want.std() > 0.1
    grad = torch.randn_like(want)
    want.backward(grad)
    got.backward(grad)
    _close(xb.grad, xa.grad)
    theirs = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        _close(p.grad, theirs[name].grad)


def test_split_scan_from_chunk_summaries_equals_the_whole_scan():
    """Pieces scanned from zero, combined through their (transition, contribution) summaries, with convolution
    halos: the same outputs and gradients as one scan; dropping the state or the halo breaks it."""
    _, ours = _pair()
    x = torch.randn(2, 24, 32, generator=torch.Generator().manual_seed(6))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = ours(xa)
    got = ours(xb, split=InOrderSplit(4))  # pieces of 6: partial chunks of 8 inside each
    _close(got, want)
    grad = torch.randn_like(want)
    want.backward(grad)
    got.backward(grad)
    _close(xb.grad, xa.grad)
    with torch.no_grad():
        assert (ours(x, split=InOrderSplit(4, drop_state=True)) - want).abs().max() > 1e-3
        assert (ours(x, split=InOrderSplit(4, drop_halo=True)) - want).abs().max() > 1e-3
