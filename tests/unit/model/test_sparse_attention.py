"""Block-sparse windowed attention and the sliding-window ring-buffer KV cache.

The block-sparse kernels (sliding window, Longformer, BigBird) give the dense-mask reference's
outputs and gradients (fp32, 1e-5) with documents, GQA and lengths that are not a multiple of the
block; a Mistral model with a window shorter than the sequence matches HF transformers' outputs and
gradients; no forward or backward tensor grows as length^2; decoding keeps only the window.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

import tessera
from tessera.config import model_config
from tessera.model import build_model, generate
from tessera.model.attention import SlidingKVCache, block_sparse_attention
from tessera.model.masks import MaskSpec, attention_mask, block_layout

CPU = torch.device("cpu")
SPECS = {
    "window": dict(kernel="sdpa", window=5),
    "window_block_multiple": dict(kernel="sdpa", window=4),
    "longformer": dict(kernel="longformer", window=3, global_tokens=2),
    "bigbird": dict(kernel="bigbird", global_tokens=1, block_size=4, random_blocks=2),
}


def _documents(batch: int, length: int) -> torch.Tensor:
    third, half = length // 3, length // 2
    first = [0] * third + [1] * half + [2] * (length - third - half)
    return torch.tensor([first, [0] * length][:batch])


def _attention(q, k, v, fn) -> tuple[torch.Tensor, list[torch.Tensor]]:
    weights = torch.randn(q.shape, generator=torch.Generator().manual_seed(9))
    out = fn(q, k, v)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    return out, list(grads)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("name", list(SPECS))
def test_block_sparse_equals_dense_mask(name, documents, causal):
    spec = MaskSpec(causal=causal, max_len=64, **SPECS[name])
    length = 45
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, length, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, 2, length, 8, generator=gen, requires_grad=True) for _ in range(2))
    docs = _documents(2, length) if documents else None
    layout = block_layout(spec, length, CPU, docs)
    assert layout is not None and layout.keys_per_query < length
    mask = attention_mask(spec, length, length, CPU, docs)

    def dense(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)

    want, want_grads = _attention(q, k, v, dense)
    got, got_grads = _attention(q, k, v, lambda q, k, v: block_sparse_attention(q, k, v, layout, 0.3))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)


@pytest.mark.parametrize("pattern", ["A", "AG"])  # 'G' layers: the same attention without the window
def test_decoder_block_path_equals_dense_eager_path_with_gradients(pattern):
    cfg = dict(vocab_size=300, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, init_std=0.2)
    cfg["layer_pattern"] = pattern
    tokens = torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(3))
    docs = _documents(2, 48)
    losses, grads = [], []
    for kernel in ("sdpa", "eager"):  # eager keeps the dense mask (it hands full weights to observers)
        torch.manual_seed(0)
        model = build_model(model_config(**cfg, attention={"kernel": kernel, "sliding_window": 6}))
        if kernel == "sdpa":
            ctx = model.context(2, 48, 0, None, docs, CPU)
            assert ctx.blocks is not None and ctx.mask is None  # the block-sparse path is the one under test
        loss = model(tokens, document_ids=docs).logsumexp(-1).mean()
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters()})
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=0)
    for name, g in grads[0].items():
        torch.testing.assert_close(g, grads[1][name], rtol=0, atol=1e-5)


def test_mistral_with_a_window_shorter_than_the_sequence_matches_hf(tmp_path):
    hf_cfg = transformers.MistralConfig(
        vocab_size=320,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        sliding_window=12,
    )
    torch.manual_seed(0)
    hf = transformers.MistralForCausalLM(hf_cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.15) if p.ndim > 1 else p.normal_(1, 0.1)
    hf.save_pretrained(tmp_path / "hf")
    model = tessera.load(tmp_path / "hf")
    assert model.context(1, 96, 0, None, None, CPU).blocks is not None
    x = torch.randint(4, 320, (2, 96), generator=torch.Generator().manual_seed(2))
    ours, theirs = model(x), hf(x).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
    (ours.logsumexp(-1).mean()).backward()
    (theirs.logsumexp(-1).mean()).backward()
    pairs = {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "layers.0.attention.q_proj.weight": "model.layers.0.self_attn.q_proj.weight",
        "layers.1.attention.v_proj.weight": "model.layers.1.self_attn.v_proj.weight",
        "layers.0.attention.o_proj.weight": "model.layers.0.self_attn.o_proj.weight",
    }
    mine, hfs = dict(model.named_parameters()), dict(hf.named_parameters())
    for ours_name, hf_name in pairs.items():
        torch.testing.assert_close(mine[ours_name].grad, hfs[hf_name].grad, rtol=0, atol=1e-5)


class _LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("kernel", ["sdpa", "longformer", "bigbird"])
def test_no_tensor_grows_with_length_squared(kernel):
    length = 1024
    cfg = dict(vocab_size=64, dim=16, n_layers=1, n_heads=2, max_seq_len=length)
    window = {"kernel": kernel, "sliding_window": 32, "block_size": 32, "global_tokens": 2}
    torch.manual_seed(0)
    sparse = build_model(model_config(**cfg, attention=window))
    dense = build_model(model_config(**cfg, attention={**window, "kernel": "eager"}))
    tokens = torch.randint(0, 64, (1, length))
    sizes = {}
    for name, model in (("sparse", sparse), ("dense", dense)):
        with _LargestTensor() as probe:
            model(tokens).sum().backward()
        sizes[name] = probe.largest
    assert sizes["dense"] >= length * length  # the probe sees dense scores when they exist
    assert sizes["sparse"] < length * length // 8, sizes


def test_sliding_window_cache_keeps_only_the_window():
    torch.manual_seed(0)
    model = build_model(
        model_config(vocab_size=300, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, sliding_window=6)
    ).eval()
    tokens = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(1))
    caches = model.new_caches(2, 64)
    assert all(isinstance(c, SlidingKVCache) and c.k.shape[2] == 6 for c in caches)
    with torch.no_grad():
        full = model(tokens)
        pieces = [model(tokens[:, :13], caches, 0), model(tokens[:, 13:16], caches, 13)]
        pieces += [model(tokens[:, i : i + 1], caches, i) for i in range(16, 40)]
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=0, atol=1e-5)
    out = generate(model, tokens[:, :4], 50, temperature=0)  # beyond the window many times over
    seq = tokens[:, :4]
    with torch.no_grad():
        for _ in range(50):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq[:, 4:])
