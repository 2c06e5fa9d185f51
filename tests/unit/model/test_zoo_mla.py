"""Multi-head latent attention: cached decoding equals the full forward, the cache holds only the latent and the
shared RoPE key, and the knobs validate. (HF DeepSeek-V3 parity is in test_hf.py.)"""

from __future__ import annotations

import pytest
import torch

from tessera.config import ConfigError, model_config
from tessera.validate import validate_model
from tessera.model import build_model
from tessera.model.generate import cache_footprint
from tessera.model.mla import LatentAttention, LatentCache

V = 97
MLA = {"kv_rank": 16, "q_rank": 12, "rope_head_dim": 8, "nope_head_dim": 8, "v_head_dim": 12}


def _model(**kw) -> torch.nn.Module:
    torch.manual_seed(0)
    base = dict(vocab_size=V, dim=32, n_layers=2, n_heads=4, max_seq_len=64, mla=MLA)
    return build_model(model_config(**{**base, **kw})).eval()


@pytest.mark.parametrize("kw", [dict(), dict(sliding_window=5), dict(mla={**MLA, "q_rank": 0}, attention="eager")])
def test_cached_decoding_equals_full_forward(kw):
    model = _model(**kw)
    assert isinstance(model.layers["0"].attention, LatentAttention)
    x = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(x)
        caches = model.new_caches(2, 16)
        assert all(isinstance(c, LatentCache) for c in caches)
        steps = [model(x[:, :9], caches, 0)] + [model(x[:, i : i + 1], caches, i) for i in range(9, 16)]
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5)


def test_latent_cache_is_smaller_than_the_heads_it_replaces():
    mla, _ = cache_footprint(_model())
    assert mla == 2 * (16 + 8) * 4  # layers x (latent + shared RoPE key) x fp32
    mha, _ = cache_footprint(_model(mla={"kv_rank": 0}, head_dim=20))  # same q/k width (nope + rope) per head
    assert mha == 2 * 2 * 4 * 20 * 4  # layers x (K, V) x heads x head_dim x fp32
    assert mla / mha == pytest.approx(24 / 160)  # 15% of the standard cache


def test_mla_trains_and_every_projection_gets_gradient():
    model = _model().train()
    x = torch.randint(0, V, (2, 12))
    model(x).logsumexp(-1).mean().backward()
    attention = model.layers["1"].attention
    for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
        assert getattr(attention, name).weight.grad.abs().sum() > 0, name


@pytest.mark.parametrize(
    "kw, key",
    [
        (dict(position="learned"), "model.mla"),
        (dict(mla={**MLA, "rope_head_dim": 7}), "rotary width"),
        (dict(attention="linear"), "model.mla"),
    ],
)
def test_invalid_mla_configs(kw, key):
    with pytest.raises(ConfigError, match=key):
        validate_model(model_config(**{**dict(vocab_size=V, dim=32, n_layers=2, n_heads=4, mla=MLA), **kw}))
