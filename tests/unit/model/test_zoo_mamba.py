"""Mamba / Mamba-2 mixers and hybrid stacks: the parallel scans equal the plain recurrence, chunking does not
change the numbers, cached decoding equals the full forward, and layer_pattern builds the stack it names.
(HF parity of the mixers and of Jamba is in test_hf.py.)"""

from __future__ import annotations

import pytest
import torch

from tessera.config import ConfigError, model_config
from tessera.validate import validate_model
from tessera.model import build_model, generate
from tessera.model.generate import cache_footprint
from tessera.model.mamba import prefix_scan, selective_scan, ssd_scan

V = 97


def _naive(a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor) -> torch.Tensor:
    h, states = h0, []
    for t in range(a.shape[1]):
        h = a[:, t] * h + b[:, t]
        states.append(h)
    return torch.stack(states, dim=1)


def test_prefix_scan_and_selective_scan_equal_the_recurrence():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.rand(2, 13, 3, 4, generator=gen), torch.randn(2, 13, 3, 4, generator=gen)
    cum, states = prefix_scan(a, b)
    assert torch.allclose(states, _naive(a, b, torch.zeros(2, 3, 4)), atol=1e-5)
    assert torch.allclose(cum, a.cumprod(dim=1), atol=1e-6)
    c, h0 = torch.randn(2, 13, 4, generator=gen), torch.randn(2, 3, 4, generator=gen)
    want = _naive(a, b, h0)
    for chunk in (1, 4, 13, 64):
        y, last = selective_scan(a, b, c, h0, chunk)
        assert torch.allclose(y, torch.einsum("bten,btn->bte", want, c), atol=1e-5)
        assert torch.allclose(last, want[:, -1], atol=1e-5)


def test_ssd_scan_equals_the_recurrence_for_any_chunk():
    gen = torch.Generator().manual_seed(1)
    b_, t, h, p, n = 2, 19, 3, 4, 5
    x, log_decay = torch.randn(b_, t, h, p, generator=gen), -torch.rand(b_, t, h, generator=gen)
    bm, cm, h0 = (
        torch.randn(b_, t, h, n, generator=gen),
        torch.randn(b_, t, h, n, generator=gen),
        torch.randn(b_, h, p, n),
    )
    state, want = h0, []
    for i in range(t):
        state = state * log_decay[:, i].exp()[..., None, None] + x[:, i, ..., None] * bm[:, i, :, None, :]
        want.append(torch.einsum("bhpn,bhn->bhp", state, cm[:, i]))
    for chunk in (1, 4, 19, 64):
        y, last = ssd_scan(x, log_decay, bm, cm, h0, chunk)
        assert torch.allclose(y, torch.stack(want, dim=1), atol=1e-5)
        assert torch.allclose(last, state, atol=1e-5)


def _model(**kw) -> torch.nn.Module:
    torch.manual_seed(0)
    base = dict(vocab_size=V, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=64)
    model = build_model(model_config(**{**base, **kw})).eval()
    with torch.no_grad():  # decays and time steps that make the state matter over many positions
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.rand_like(p) * 2)
    return model


MAMBA1 = dict(layer_pattern="M", mamba={"state": 8, "chunk": 4, "ffn": False})
MAMBA2 = dict(layer_pattern="M", mamba={"version": 2, "state": 8, "head_dim": 16, "groups": 2, "chunk": 4})
HYBRID = dict(layer_pattern="MA", moe={"experts": 4, "every": 2}, mamba={"state": 8, "chunk": 4, "dt_norm": True})


@pytest.mark.parametrize("kw", [MAMBA1, MAMBA2, HYBRID], ids=["mamba", "mamba2", "hybrid"])
def test_chunking_and_cached_decoding_equal_the_full_forward(kw):
    model = _model(**kw)
    x = torch.randint(0, V, (2, 21), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(x)
        other = _model(**{**kw, "mamba": {**kw["mamba"], "chunk": 64}})
        assert torch.allclose(other(x), full, atol=1e-5)  # the chunk length is memory, not numbers
        caches = model.new_caches(2, 21)
        steps = [model(x[:, :9], caches, 0), model(x[:, 9:13], caches, 9)]  # a prompt, then several tokens at once
        steps += [model(x[:, i : i + 1], caches, i) for i in range(13, 21)]
        assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5)
        again = model(x[:, :9], caches, 0)  # start 0 resets the state of a reused cache
        assert torch.allclose(again, full[:, :9], atol=1e-5)
    assert full.std() > 0.1


def test_layer_pattern_builds_the_named_stack_and_trains():
    model = _model(layer_pattern="MMAM", moe={"experts": 4, "every": 2}, mamba={"state": 8})
    layers = list(model.layers.values())
    assert [layer.kind for layer in layers] == ["M", "M", "A", "M"]
    assert [layer.mamba is not None for layer in layers] == [True, True, False, True]
    assert [layer.moe is not None for layer in layers] == [False, True, False, True]
    pure = _model(**MAMBA1)
    assert all(
        layer.feed_forward is None and layer.moe is None and layer.ffn_norm is None for layer in pure.layers.values()
    )
    model.train()
    x = torch.randint(0, V, (2, 16))
    loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert all(g is not None and g.abs().sum() > 0 for n, g in grads.items() if ".mamba." in n)


def test_mamba_state_is_fixed_size_and_generation_runs():
    model = _model(**MAMBA2)
    per_token, fixed = cache_footprint(model)
    assert per_token == 0 and fixed > 0
    hybrid = _model(**HYBRID)
    per_token, fixed = cache_footprint(hybrid)
    assert per_token == 2 * 2 * 2 * 8 * 4  # two attention layers: K and V, 2 kv heads of 8, fp32
    out = generate(model, torch.randint(0, V, (1, 4)), 6, temperature=0)
    assert out.shape == (1, 6)


@pytest.mark.parametrize(
    "kw, key",
    [
        (dict(layer_pattern="MX"), "layer_pattern"),
        (dict(n_layers=4, layer_pattern="MAM"), "tile"),
        (dict(layer_pattern="MG"), "sliding_window"),
        (dict(layer_pattern="M", mamba={"version": 3}), "model.mamba.version"),
        (dict(layer_pattern="M", mamba={"version": 2, "head_dim": 24}), "head_dim"),
        (dict(layer_pattern="M", mamba={"version": 2, "dt_norm": True}), "dt_norm"),
        (dict(arch="encoder", layer_pattern="M"), "decoders"),
    ],
)
def test_invalid_mixer_configs_are_one_line_errors(kw, key):
    with pytest.raises(ConfigError, match=key):
        validate_model(model_config(**{**dict(vocab_size=V, dim=32, n_layers=4, n_heads=4), **kw}))
