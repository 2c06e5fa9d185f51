"""Every recurrent mixer over a sequence split into pieces (what context parallelism runs: each piece scanned from
zero, the (transition, contribution) summaries combined in order, each piece rescanned from the state entering it,
convolution halos from the piece before) equals the unsplit forward, outputs and input gradients, with and without
packed documents (one boundary inside a piece, one on a piece boundary); dropping the state, the halo or the reset
at a piece boundary breaks it."""

from __future__ import annotations

import pytest
import torch

from tessera.config import model_config
from tessera.model.gated_deltanet import GatedDeltaNet
from tessera.model.kernels.linear import PerformerFeatures, linear_attention, split_linear_attention
from tessera.model.mamba import Mamba2Mixer, MambaMixer

from helpers.splits import InOrderSplit

# 24 positions in 4 pieces of 6: a boundary inside piece 1 (at 9) and one on the boundary of pieces 2 and 3 (at 18).
DOCS = torch.tensor([[0] * 9 + [1] * 9 + [2] * 6, [0] * 24])


def _mixer(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gdn":
        gdn = dict(key_heads=2, value_heads=4, key_head_dim=8, value_head_dim=6, conv=4, chunk=4)
        return GatedDeltaNet(model_config(dim=32, norm_eps=1e-6, gdn=gdn))
    mamba = dict(version=1 if kind == "mamba" else 2, state=8, conv=4, expand=2, head_dim=16, chunk=4, conv_bias=True)
    cfg = model_config(dim=32, norm_eps=1e-6, mamba=mamba)
    module = MambaMixer(cfg) if kind == "mamba" else Mamba2Mixer(cfg)
    with torch.no_grad():  # spread-out decays so the state carries between pieces
        module.A_log.copy_(torch.rand_like(module.A_log) * 2 - 2)
    return module


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> None:
    scale = b.abs().max().clamp_min(1.0)
    assert (a - b).abs().max().item() <= tol * scale, f"max diff {(a - b).abs().max().item():.2e}"


@pytest.mark.parametrize("kind", ["gdn", "mamba", "mamba2"])
@pytest.mark.parametrize("documents", [False, True])
def test_split_mixer_equals_the_whole_scan(kind, documents):
    module = _mixer(kind)
    docs = DOCS if documents else None
    x = torch.randn(2, 24, 32, generator=torch.Generator().manual_seed(1))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = module(xa, document_ids=docs)
    got = module(xb, document_ids=docs, split=InOrderSplit(4))
    _close(got, want)
    grad = torch.randn_like(want)
    want.backward(grad)
    got.backward(grad)
    _close(xb.grad, xa.grad)
    with torch.no_grad():
        for broken in (InOrderSplit(4, drop_state=True), InOrderSplit(4, drop_halo=True)):
            assert (module(x, document_ids=docs, split=broken) - want).abs().max() > 1e-4


def test_documents_reset_the_state_across_pieces():
    """Each packed document alone equals its slice of the split, packed forward (row 0 of DOCS)."""
    module = _mixer("mamba2")
    x = torch.randn(1, 24, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        packed = module(x, document_ids=DOCS[:1], split=InOrderSplit(4))
        for lo, hi in ((0, 9), (9, 18), (18, 24)):
            _close(packed[:, lo:hi], module(x[:, lo:hi]))


@pytest.mark.parametrize("performer", [False, True])
def test_split_linear_attention_equals_the_prefix_sums(performer):
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 24, 8, generator=gen) for _ in range(3))
    if performer:
        torch.manual_seed(0)
        features = PerformerFeatures(8, 16)
        phi = lambda x, query, split=None: features(x, is_query=query, split=split)  # noqa: E731
    else:
        phi = lambda x, query, split=None: torch.nn.functional.elu(x) + 1  # noqa: E731
    want = linear_attention(phi(q, True), phi(k, False), v, causal=True)
    split = InOrderSplit(4)
    got = split_linear_attention(phi(q, True), phi(k, False, split), v, split)
    _close(got, want)
    broken = InOrderSplit(4, drop_state=True)
    assert (split_linear_attention(phi(q, True), phi(k, False, broken), v, broken) - want).abs().max() > 1e-3
