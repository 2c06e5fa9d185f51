"""Packed documents through recurrent hybrids: with ``document_ids`` every recurrent state (Gated DeltaNet, Mamba,
Mamba-2) and convolution window restarts at each boundary, so a packed row's logits equal each document's alone."""

from __future__ import annotations

import pytest
import torch

from tessera.config import ConfigError, model_config
from tessera.model import build_model
from tessera.validate import load_config

_BASE = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=64)
HYBRIDS = {
    "gated_deltanet": dict(
        layer_pattern="DA", gdn=dict(key_heads=2, value_heads=4, key_head_dim=8, value_head_dim=8, chunk=4)
    ),
    "mamba": dict(layer_pattern="MA", mamba=dict(version=1, state=8, chunk=4)),
    "mamba2": dict(layer_pattern="MA", mamba=dict(version=2, state=8, head_dim=16, chunk=4)),
}


@pytest.mark.parametrize("name", sorted(HYBRIDS))
def test_packed_documents_equal_each_document_alone(name):
    torch.manual_seed(0)
    model = build_model(model_config(**_BASE, **HYBRIDS[name])).eval()
    lengths = [7, 1, 12, 10]  # boundaries inside chunks, on a chunk edge, a one-token document
    tokens = torch.randint(0, 64, (1, sum(lengths)), generator=torch.Generator().manual_seed(1))
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    with torch.no_grad():
        packed = model(tokens, document_ids=docs)
        alone = torch.cat([model(part) for part in tokens.split(lengths, dim=1)], dim=1)
        unmasked = model(tokens)
    assert (packed - alone).abs().max().item() <= 1e-5
    assert (unmasked - alone).abs().max().item() > 1e-3  # without the ids the state crosses the boundaries


def test_document_mask_is_accepted_for_recurrent_layers_and_refused_for_linear_kernels(tmp_path):
    base = ["model.dim=32", "model.n_layers=2", "model.n_heads=4", "data.document_mask=true"]
    load_config(None, [*base, "model.layer_pattern=MA"])
    load_config(None, [*base, "model.layer_pattern=DA"])
    with pytest.raises(ConfigError, match="document_mask cannot stop model.attention.kernel='linear'"):
        load_config(None, [*base, "model.attention.kernel=linear"])
