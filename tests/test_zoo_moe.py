"""Mixture of experts: routing equals a per-token reference, capacity drops, aux/z losses, stats."""

from __future__ import annotations

import math

import pytest
import torch

from tessera.config import ModelConfig
from tessera.model import build_model, expert_load, moe_losses, moe_metrics
from tessera.model.moe import MoE


def _moe(**kw) -> MoE:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=300, dim=16, n_heads=2, moe_experts=4, moe_ffn_hidden=24, **kw)
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return moe


def _reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: the chosen experts' outputs weighted by the router."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.zeros_like(flat)
    for n, token in enumerate(flat):
        weights, ids, _ = moe.route(moe.router(token[None]).float())
        for w, e in zip(weights[0], ids[0]):
            out[n] += w * moe.experts.expert(int(e), token[None])[0]
    return out.view(x.shape)


@pytest.mark.parametrize("router, top_k", [("topk_softmax", 2), ("softmax_topk", 1), ("softmax_topk", 2)])
def test_routing_matches_per_token_reference(router, top_k):
    moe = _moe(moe_router=router, moe_top_k=top_k)
    x = torch.randn(2, 5, 16)
    assert torch.allclose(moe(x), _reference(moe, x), atol=1e-5)
    weights, _, probs = moe.route(moe.router(x.reshape(-1, 16)).float())
    if router == "topk_softmax":
        assert torch.allclose(weights.sum(-1), torch.ones(10))  # renormalized over the chosen experts
    else:
        assert torch.allclose(weights[:, 0], probs.max(-1).values)  # switch: the raw top probability


def test_capacity_drops_overflow_tokens():
    moe = _moe(moe_top_k=1, moe_capacity_factor=0.5)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[2] = 1.0  # every token prefers expert 2
    x = torch.rand(1, 8, 16) + 0.1
    out = moe(x)
    capacity = math.ceil(0.5 * 8 / 4)
    kept = (out.abs().sum(-1) > 0).sum().item()
    assert kept == capacity and moe.dropped == pytest.approx(1 - capacity / 8)
    assert torch.allclose(out[0, :capacity], _reference(moe, x)[0, :capacity], atol=1e-5)  # earlier tokens win


def test_aux_and_z_losses_and_stats():
    moe = _moe(moe_top_k=2)
    with torch.no_grad():
        moe.router.weight.zero_()
    moe(torch.randn(3, 4, 16))
    assert moe.aux_loss.item() == pytest.approx(2.0)  # uniform router: E * sum(k/E * 1/E) = k
    assert moe.z_loss.item() == pytest.approx(math.log(4) ** 2)
    assert moe.load.sum().item() == pytest.approx(1.0)


def test_model_level_losses_metrics_and_layout():
    cfg = ModelConfig(vocab_size=300, dim=32, n_layers=4, n_heads=4, moe_experts=4, moe_every=2, moe_shared_experts=1, moe_z_loss_coef=0.01)
    model = build_model(cfg)
    assert [hasattr(layer, "moe") for layer in model.layers.values()] == [False, True, False, True]
    bank = model.layers["1"].moe.experts
    assert bank.gate_proj.shape == (4, 32, 96) and bank.down_proj.shape == (4, 96, 32)
    assert model.layers["1"].moe.shared is not None
    model(torch.randint(0, 300, (2, 8)))
    loss = moe_losses(model)
    assert loss.requires_grad
    loss.backward()
    assert model.layers["1"].moe.router.weight.grad.abs().sum() > 0
    metrics = moe_metrics(model)
    assert set(metrics) == {"moe_aux_loss", "moe_z_loss", "moe_dropped", "moe_load_max"}
    assert len(expert_load(model)) == 2
    assert moe_losses(build_model(ModelConfig(vocab_size=300, dim=32, n_layers=1, n_heads=4))) is None
