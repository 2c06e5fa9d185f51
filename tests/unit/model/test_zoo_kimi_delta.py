"""Kimi Delta Attention: the mixer against HF's KimiLinearDeltaAttention (outputs and gradients, fp32 1e-5), our
chunked and recurrent forms against HF's torch chunk/recurrent KDA functions, chunked against recurrent on every
position (with and without document boundaries), decoding with the state cache against full recomputation, and
packed documents against each document alone."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.kimi_linear import modeling_kimi_linear as hf_kimi

from tessera.config import model_config
from tessera.model.gated_deltanet import chunk_gated_delta_rule, decayed_products, recurrent_gated_delta_rule
from tessera.model.kimi_delta import KimiDeltaAttention

TOL = 1e-5
_KDA = dict(heads=3, head_dim=8, conv=4, chunk=8)
_RENAMES = {f"forget_gate.{n}": n for n in ("f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log")}


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = TOL) -> None:
    scale = b.abs().max().clamp_min(1.0)
    assert (a - b).abs().max().item() <= tol * scale, f"max diff {(a - b).abs().max().item():.2e}"


def _ours_from(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF's module state -> ours (the checkpoint's names: the forget gate one level up, three convolutions)."""
    state = {_RENAMES.get(name, name): t for name, t in hf_state.items()}
    conv = state.pop("conv1d.weight")
    state.update(zip(("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"), conv.chunk(3)))
    return state


def _pair(seed: int = 0) -> tuple[torch.nn.Module, KimiDeltaAttention]:
    """HF's layer with spread-out random weights and ours loaded from its state dict."""
    hfc = transformers.KimiLinearConfig(
        hidden_size=32,
        linear_num_heads=3,
        linear_head_dim=8,
        linear_conv_kernel_dim=4,
        num_hidden_layers=1,
        rms_norm_eps=1e-6,
    )
    hf = hf_kimi.KimiLinearDeltaAttention(hfc, 0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(torch.rand(p.shape, generator=gen) - 1.0 if name.endswith("A_log") else 0.3 * noise)
    ours = KimiDeltaAttention(model_config(dim=32, norm_eps=1e-6, kda=_KDA))
    ours.load_state_dict(_ours_from(hf.state_dict()))
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
    theirs = _ours_from({n: p.grad for n, p in hf.named_parameters()})
    for name, p in ours.named_parameters():
        _close(p.grad, theirs[name])


def _rule_inputs(b=2, h=3, t=37, dk=8, dv=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(b, h, t, dk, generator=gen), dim=-1) * dk**-0.5
    k = torch.nn.functional.normalize(torch.randn(b, h, t, dk, generator=gen), dim=-1)
    v = torch.randn(b, h, t, dv, generator=gen)
    g = -torch.rand(b, h, t, dk, generator=gen) * torch.rand(1, h, 1, dk, generator=gen) * 2  # per key channel
    beta = torch.rand(b, h, t, generator=gen)
    state = torch.randn(b, h, dk, dv, generator=gen)
    return q, k, v, g, beta, state


def test_kernels_match_hf_kernels():
    """Our chunked and recurrent forms against HF's chunk/recurrent_kimi_delta_attention (HF takes (B, T, H, D) and
    scales q itself)."""
    q, k, v, g, beta, state = _rule_inputs(dv=8)
    dk = q.shape[-1]
    args = [t.transpose(1, 2) for t in (q * dk**0.5, k, v, g, beta)]
    kw = dict(initial_state=state, output_final_state=True)
    want, want_state = hf_kimi.chunk_kimi_delta_attention(*args[:3], g=args[3], beta=args[4], chunk_size=8, **kw)
    got, got_state = chunk_gated_delta_rule(q, k, v, g, beta, 8, state)
    _close(got.transpose(1, 2), want)
    _close(got_state, want_state)
    want, want_state = hf_kimi.recurrent_kimi_delta_attention(*args[:3], g=args[3], beta=args[4], **kw)
    got, got_state = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    _close(got.transpose(1, 2), want)
    _close(got_state, want_state)


def test_blocked_products_equal_every_pair_and_survive_strong_decay():
    """The per-channel products in blocks of 16 against the (L, L, D) tensor of every pair; with a decay strong
    enough that exp(-cumsum) overflows float32, the blocks stay finite (each factor is at most 1)."""
    gen = torch.Generator().manual_seed(5)
    a, b = torch.randn(2, 64, 8, generator=gen), torch.randn(2, 64, 8, generator=gen)
    cum = (-torch.rand(2, 64, 8, generator=gen) * 4).cumsum(-2)
    pairs = (a[:, :, None] * b[:, None] * (cum[:, :, None] - cum[:, None]).exp()).sum(-1).tril()
    _close(decayed_products(a, b, cum), pairs)
    strong = cum * 10  # down to about -1300: exp(1300) is inf
    got = decayed_products(a, b, strong)
    assert torch.isfinite(got).all()
    _close(got, (a[:, :, None] * b[:, None] * (strong[:, :, None] - strong[:, None]).clamp(max=0).exp()).sum(-1).tril())


@pytest.mark.parametrize("chunk", [1, 4, 16, 32])
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
    assert cache.bytes() == 2 * (3 * 24 * 3 + 3 * 8 * 8) * 4  # fixed, whatever the length: conv window + state


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
