"""Attention sinks (gpt-oss) against transformers' GptOssAttention: outputs and gradients in fp32 (1e-5),
for every kernel that holds a sink (sdpa dense and causal, the block-sparse sliding window, eager,
score biases, documents, KV-cached decoding)."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.gpt_oss import modeling_gpt_oss as hf_gpt_oss

from tessera.config import model_config
from tessera.model.attention import Attention, AttnContext, KVCache
from tessera.model.masks import MaskSpec, allowed, attention_mask, block_layout
from tessera.model.sinks import with_sink_key

DIM, HEADS, KV_HEADS, HEAD_DIM, T = 32, 4, 2, 8, 40


def _pair(kernel: str, window: int) -> tuple[torch.nn.Module, Attention]:
    """A random HF GptOssAttention and a tessera Attention holding the same weights and sinks."""
    cfg = transformers.GptOssConfig(
        hidden_size=DIM,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        num_hidden_layers=1,
        sliding_window=window or 128,
        attention_bias=True,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = hf_gpt_oss.GptOssAttention(cfg, 0)
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.2)
    ours = Attention(
        model_config(
            dim=DIM,
            n_heads=HEADS,
            n_kv_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            attention={"kernel": kernel, "sinks": True, "qkv_bias": True, "o_bias": True, "sliding_window": window},
        )
    )
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(ours, name).weight.copy_(getattr(hf, name).weight)
            getattr(ours, name).bias.copy_(getattr(hf, name).bias)
        ours.sinks.weight.copy_(hf.sinks)
    return hf, ours


def _hf_forward(hf: torch.nn.Module, x: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """HF's attention with identity RoPE (cos 1, sin 0) and the additive form of the bool mask ``ok``."""
    cos = torch.ones(x.shape[0], x.shape[1], HEAD_DIM // 2)
    mask = torch.zeros(ok.shape).masked_fill(~ok, float("-inf"))
    return hf(x, (cos, torch.zeros_like(cos)), mask)[0]


def _grads(module: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The input's gradient and every parameter's, by HF's parameter name."""
    grads = {name.replace("sinks.weight", "sinks"): p.grad for name, p in module.named_parameters()}
    return {"input": x.grad, **grads}


def _context(kernel: str, window: int, docs: torch.Tensor | None) -> tuple[AttnContext, torch.Tensor]:
    """tessera's context for T queries (block-sparse for the sdpa window) and the bool mask it means."""
    spec = MaskSpec(kernel, True, window)
    pos = torch.arange(T)
    ok = allowed(spec, pos[:, None], pos[None, :], *(() if docs is None else (docs[:, :, None], docs[:, None])))
    ok = ok[:, None] if docs is not None else ok[None, None]
    if kernel == "sdpa" and window and docs is None:
        layout = block_layout(spec, T, torch.device("cpu"))
        assert layout is not None, "the window must run block-sparse"
        return AttnContext(blocks=layout, causal=True), ok
    mask = attention_mask(spec, T, T, torch.device("cpu"), docs)
    return AttnContext(mask=mask, is_causal=mask is None, causal=True), ok


CASES = [("sdpa", 0, False), ("sdpa", 8, False), ("eager", 0, False), ("eager", 8, False), ("sdpa", 0, True)]


@pytest.mark.parametrize(("kernel", "window", "documents"), CASES)
def test_sinks_match_gpt_oss_attention(kernel, window, documents):
    """Outputs and the gradients of the input, every projection and the sinks equal HF's (fp32 1e-5)."""
    hf, ours = _pair(kernel, window)
    docs = torch.tensor([[0] * 15 + [1] * 25, [0] * 30 + [1] * 10]) if documents else None
    ctx, ok = _context(kernel, window, docs)
    x = torch.randn(2, T, DIM, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    ref = _hf_forward(hf, x, ok)
    out = ours(x2, ctx)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    (ref * torch.linspace(-1, 1, DIM)).sum().backward()
    (out * torch.linspace(-1, 1, DIM)).sum().backward()
    mine, theirs = _grads(ours, x2), _grads(hf, x)
    assert mine.keys() == theirs.keys()
    for name, grad in mine.items():
        torch.testing.assert_close(grad, theirs[name], rtol=1e-5, atol=1e-5, msg=name)
    assert ours.sinks.weight.grad.abs().min() > 0  # the sinks are trained


def test_sinks_change_the_output():
    """The sink is not a no-op: large sinks drain the weights (an output near o_proj's bias)."""
    _, ours = _pair("sdpa", 0)
    x = torch.randn(1, T, DIM)
    ctx = AttnContext(is_causal=True, causal=True)
    before = ours(x, ctx)
    with torch.no_grad():
        ours.sinks.weight.fill_(30.0)
    drained = ours(x, ctx)
    assert (before - drained).abs().max() > 1e-2
    torch.testing.assert_close(drained, ours.o_proj.bias.expand_as(drained), rtol=0, atol=1e-6)


def test_cached_decoding_with_sinks_matches_the_full_forward():
    """Prefill then one-token steps through a KV cache give the full causal forward's outputs."""
    _, ours = _pair("sdpa", 0)
    x = torch.randn(1, 12, DIM)
    full = ours(x, AttnContext(is_causal=True, causal=True))
    cache = KVCache(1, KV_HEADS, HEAD_DIM, 12, torch.float32, torch.device("cpu"))
    steps = [ours(x[:, :8], AttnContext(is_causal=True, causal=True), cache, 0)]
    steps += [ours(x[:, i : i + 1], AttnContext(causal=True), cache, i) for i in range(8, 12)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)


def test_the_virtual_key_scores_exactly_the_sink():
    """Each query head's score of the virtual key is its own sink logit (GQA: heads of one group differ)."""
    q, k, v = (torch.randn(2, h, 5, HEAD_DIM) for h in (HEADS, KV_HEADS, KV_HEADS))
    sinks, scale = torch.tensor([0.5, -1.0, 2.0, 3.0]), 0.3
    q2, k2, v2 = with_sink_key(q, k, v, sinks, scale)
    scores = (q2.view(2, KV_HEADS, 2, 5, -1) @ k2[:, :, None].transpose(-2, -1)) * scale
    torch.testing.assert_close(scores[..., 0].reshape(2, HEADS, 5), sinks.view(1, HEADS, 1).expand(2, HEADS, 5))
    torch.testing.assert_close(
        scores[..., 1:], (q.view(2, KV_HEADS, 2, 5, -1) @ k[:, :, None].transpose(-2, -1)) * scale
    )
    assert (v2[:, :, 0] == 0).all()


def test_gpt_oss_shaped_decoder_decodes_as_it_reads():
    """Sinks with alternating windowed (ring-buffer cache) and global layers: cached decoding gives the
    full forward's logits, and greedy generation the token-by-token argmax; the sinks shift the logits."""
    from tessera.model import build_model, generate
    from tessera.model.attention import SlidingKVCache

    cfg = model_config(
        vocab_size=300,
        dim=32,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=64,
        layer_pattern="AG",
        attention={"sinks": True, "sliding_window": 6, "qkv_bias": True, "o_bias": True},
    )
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    for layer in model.layers.values():
        torch.nn.init.normal_(layer.attention.sinks.weight, std=1.0)
    tokens = torch.randint(0, 300, (2, 30), generator=torch.Generator().manual_seed(1))
    caches = model.new_caches(2, 64)
    assert [isinstance(c, SlidingKVCache) for c in caches] == [True, False, True, False]
    with torch.no_grad():
        full = model(tokens)
        pieces = [model(tokens[:, :11], caches, 0)] + [model(tokens[:, i : i + 1], caches, i) for i in range(11, 30)]
        torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=0, atol=1e-5)
        out, seq = generate(model, tokens[:, :4], 20, temperature=0), tokens[:, :4]
        for _ in range(20):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], 1)
        assert torch.equal(out, seq[:, 4:])
        for layer in model.layers.values():
            layer.attention.sinks.weight.zero_()
        assert (model(tokens) - full).abs().max() > 1e-3


def test_pruning_heads_keeps_their_sinks():
    """Head pruning (tessera.analysis.prune) slices the sinks with the query heads it keeps."""
    from tessera.analysis.prune import prune_model
    from tessera.model import build_model

    cfg = model_config(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, attention={"sinks": True})
    model = build_model(cfg)
    torch.nn.init.normal_(model.layers["1"].attention.sinks.weight)
    pruned = prune_model(model, {1: [1]})  # layer 1 keeps KV group 1: query heads 2 and 3
    torch.testing.assert_close(pruned.layers["1"].attention.sinks.weight, model.layers["1"].attention.sinks.weight[2:])
