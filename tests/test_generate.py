"""KV-cache decoding and the samplers."""

from __future__ import annotations

import torch

from tessera.config import model_config
from tessera.model import build_model, generate, sample_next

CFG = model_config(vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(CFG).eval()


def test_cached_decoding_equals_full_forward():
    model = _model()
    tokens = torch.randint(0, CFG.vocab_size, (2, 12))
    full = model(tokens)
    caches = model.new_caches(2, 16)
    pieces = [model(tokens[:, :5], caches, 0), model(tokens[:, 5:9], caches, 5), model(tokens[:, 9:10], caches, 9), model(tokens[:, 10:], caches, 10)]
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=0, atol=1e-5)


def test_greedy_generation_is_the_argmax_loop_without_cache():
    model = _model()
    prompt = torch.randint(0, CFG.vocab_size, (2, 4))
    out = generate(model, prompt, 20, temperature=0)
    seq = prompt
    for _ in range(20):
        seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq[:, 4:])


def test_generation_stops_at_max_seq_len_and_eos():
    model = _model()
    prompt = torch.randint(0, CFG.vocab_size, (1, 60))
    assert generate(model, prompt, 50, temperature=0).shape == (1, 4)
    first = generate(model, prompt[:, :5], 1, temperature=0).item()
    assert generate(model, prompt[:, :5], 10, temperature=0, eos_id=first).shape == (1, 1)


def test_top_k_and_top_p_only_sample_allowed_tokens():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(2000, 1)
    gen = torch.Generator().manual_seed(0)
    assert set(sample_next(logits, 1.0, top_k=2, generator=gen).tolist()) == {0, 1}
    probs = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0]).softmax(0)  # 0.64, 0.24, 0.09, ...
    assert probs[0] < 0.7 < probs[0] + probs[1]
    assert set(sample_next(logits, 1.0, top_p=0.7, generator=gen).tolist()) == {0, 1}
    assert set(sample_next(logits, 1.0, top_p=0.5, generator=gen).tolist()) == {0}
    assert sample_next(logits[:1], 0.0).item() == 0


def test_sampling_is_reproducible_with_a_seeded_generator():
    model = _model()
    prompt = torch.randint(0, CFG.vocab_size, (1, 3))
    a = generate(model, prompt, 10, temperature=1.0, top_k=20, generator=torch.Generator().manual_seed(3))
    b = generate(model, prompt, 10, temperature=1.0, top_k=20, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
