"""KV-cache decoding and the samplers; left-padded batches, int8 caches, reused caches."""

from __future__ import annotations

import math

import pytest
import torch

from tessera.config import model_config
from tessera.model import build_model, generate, sample_next
from tessera.model.cache import Int8Rows, cache_footprint, new_caches
from tessera.model.generate import cached_nll, pad_left

_KW = dict(vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
CFG = model_config(**_KW)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(CFG).eval()


def test_cached_decoding_equals_full_forward():
    model = _model()
    tokens = torch.randint(0, CFG.vocab_size, (2, 12))
    full = model(tokens)
    caches = model.new_caches(2, 16)
    pieces = [
        model(tokens[:, :5], caches, 0),
        model(tokens[:, 5:9], caches, 5),
        model(tokens[:, 9:10], caches, 9),
        model(tokens[:, 10:], caches, 10),
    ]
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


@pytest.mark.parametrize("position", ["rope", "learned", "alibi"])
def test_left_padded_batch_generates_what_each_prompt_does_alone(position):
    torch.manual_seed(0)
    model = build_model(model_config(**{**_KW, "position": {"kind": position}})).eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, CFG.vocab_size, (n,), generator=gen) for n in (3, 9, 6)]
    batch = generate(model, prompts, 12, temperature=0)
    for row, prompt in zip(batch, prompts):
        assert torch.equal(row, generate(model, prompt[None], 12, temperature=0)[0])
    tokens, pad = pad_left(prompts)
    assert pad.tolist() == [6, 0, 3] and torch.equal(tokens[0, 6:], prompts[0])
    with torch.no_grad():  # the padded rows' logits are the unpadded ones (padding fully masked out)
        logits = model(tokens, model.new_caches(3, 9), left_pad=pad)
        torch.testing.assert_close(logits[0, 6:], model(prompts[0][None])[0], rtol=0, atol=1e-5)


def test_left_padding_is_refused_where_it_would_leak_into_a_state():
    model = build_model(model_config(**{**_KW, "layer_pattern": "MA", "mamba": {"state": 4}}))
    with pytest.raises(ValueError, match="left padding"):
        generate(model, [[1, 2, 3], [4]], 2)


def test_int8_cache_bytes_and_numbers():
    model = _model()
    fp32, _ = cache_footprint(model, "fp32")
    bf16, _ = cache_footprint(model, "bf16")
    int8, _ = cache_footprint(model, "int8")
    head_dim = CFG.dim // CFG.n_heads
    assert fp32 == 2 * CFG.n_layers * 2 * head_dim * 4 and bf16 == fp32 // 2  # (k, v) x layers x kv heads
    assert int8 == 2 * CFG.n_layers * 2 * (head_dim + 2)  # one int8 per channel + an fp16 scale per row
    tokens = torch.randint(0, CFG.vocab_size, (2, 40), generator=torch.Generator().manual_seed(2))
    exact = model(tokens)
    caches = new_caches(model, 2, 40, "int8")
    with torch.no_grad():
        stepped = torch.cat([model(tokens[:, i : i + 1], caches, start=i) for i in range(40)], dim=1)
    assert (stepped - exact).abs().max() < 0.05 * exact.abs().max()  # int8 error, not garbage
    assert not torch.equal(stepped, exact)  # ... and really quantized
    nll_fp32, nll_int8 = cached_nll(model, tokens, "fp32"), cached_nll(model, tokens, "int8")
    assert abs(math.exp(nll_int8) / math.exp(nll_fp32) - 1) < 0.01
    assert nll_fp32 == pytest.approx(
        torch.nn.functional.cross_entropy(exact[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).item(), rel=1e-5
    )
    nll_bf16 = cached_nll(model, tokens, "bf16")  # a bf16 cache under an fp32 model: read back as fp32
    assert nll_bf16 != nll_fp32 and abs(math.exp(nll_bf16) / math.exp(nll_fp32) - 1) < 0.01


def test_int8_rows_quantize_each_row_with_its_own_scale():
    rows = Int8Rows((2, 3, 4, 8), torch.float32, "cpu")
    x = torch.randn(2, 3, 4, 8) * torch.logspace(-3, 3, 4)[None, None, :, None]  # rows six decades apart
    rows[:, :, :] = x
    assert rows.data.dtype == torch.int8 and rows.nbytes == 2 * 3 * 4 * (8 + 2)
    err = (rows[:, :, :] - x).abs() / x.abs().amax(-1, keepdim=True)
    assert err.max() <= 0.5 / 127 + 1e-3  # half a step of each row's own scale
    rows[:, :, torch.tensor([1])] = torch.zeros(2, 3, 1, 8)
    assert torch.equal(rows[:, :, 1:2], torch.zeros(2, 3, 1, 8))


def test_preallocated_caches_are_reused():
    model = _model()
    prompt = torch.randint(0, CFG.vocab_size, (2, 5), generator=torch.Generator().manual_seed(3))
    caches = new_caches(model, 2, 32)
    first = generate(model, prompt, 20, temperature=0, caches=caches)
    storage = [c.k.data_ptr() for c in caches]
    again = generate(model, prompt.flip(0), 20, temperature=0, caches=caches)
    assert torch.equal(first, generate(model, prompt, 20, temperature=0))
    assert torch.equal(again, first.flip(0)) and [c.k.data_ptr() for c in caches] == storage
    with pytest.raises(ValueError, match="exactly 1 rows"):
        generate(model, prompt[:1], 20, caches=caches)


def test_rows_that_finish_first_repeat_eos():
    model = _model()
    prompt = torch.randint(0, CFG.vocab_size, (2, 4), generator=torch.Generator().manual_seed(5))
    free = generate(model, prompt, 12, temperature=0)
    eos = int(free[0, 2])
    assert eos not in free[1, :3].tolist()
    out = generate(model, prompt, 12, temperature=0, eos_id=eos)
    assert out[0, 3:].eq(eos).all() and torch.equal(out[0, :3], free[0, :3])
