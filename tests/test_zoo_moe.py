"""Mixture of experts: routing equals a per-token reference, capacity drops, aux/z losses, stats."""

from __future__ import annotations

import math

import pytest
import torch

from tessera.config import model_config
from tessera.model import MoELog, build_model, expert_load, moe_loss, moe_metrics
from tessera.model.moe import MoE


def _moe(**kw) -> MoE:
    torch.manual_seed(0)
    cfg = model_config(vocab_size=300, dim=16, n_heads=2, moe_experts=4, moe_ffn_hidden=24, **kw)
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
    log = MoELog()
    out = moe(x, log)
    capacity = math.ceil(0.5 * 8 / 4)
    kept = (out.abs().sum(-1) > 0).sum().item()
    assert kept == capacity and log.layers[moe].dropped.item() == pytest.approx(1 - capacity / 8)
    assert torch.allclose(out[0, :capacity], _reference(moe, x)[0, :capacity], atol=1e-5)  # earlier tokens win


def test_aux_and_z_losses_and_stats():
    moe = _moe(moe_top_k=2)
    with torch.no_grad():
        moe.router.weight.zero_()
    log = MoELog()
    moe(torch.randn(3, 4, 16), log)
    stats = log.layers[moe]
    assert stats.aux_loss.item() == pytest.approx(2.0)  # uniform router: E * sum(k/E * 1/E) = k
    assert stats.z_loss.item() == pytest.approx(math.log(4) ** 2)
    assert stats.load.sum().item() == pytest.approx(1.0)
    assert stats.loss.item() == pytest.approx(0.01 * 2.0)  # aux_loss_coef 0.01, z_loss_coef 0


def test_model_level_losses_metrics_and_layout():
    cfg = model_config(vocab_size=300, dim=32, n_layers=4, n_heads=4, moe_experts=4, moe_every=2, moe_shared_experts=1, moe_z_loss_coef=0.01)
    model = build_model(cfg)
    assert [layer.moe is not None for layer in model.layers.values()] == [False, True, False, True]
    assert [layer.feed_forward is None for layer in model.layers.values()] == [False, True, False, True]
    bank = model.layers["1"].moe.experts
    assert bank.gate_proj.shape == (4, 32, 96) and bank.down_proj.shape == (4, 96, 32)
    assert model.layers["1"].moe.shared is not None
    log = MoELog()
    model(torch.randint(0, 300, (2, 8)), moe_log=log)
    loss = moe_loss(log)
    assert loss.requires_grad
    loss.backward()
    assert model.layers["1"].moe.router.weight.grad.abs().sum() > 0
    metrics = moe_metrics([log])
    assert set(metrics) == {"moe_aux_loss", "moe_z_loss", "moe_dropped", "moe_load_max"}
    assert len(expert_load(log)) == 2
    assert not any(isinstance(v, torch.Tensor) for m in model.modules() for v in vars(m).values())  # no state kept
    dense_log = MoELog()
    build_model(model_config(vocab_size=300, dim=32, n_layers=1, n_heads=4))(torch.randint(0, 300, (2, 8)), moe_log=dense_log)
    assert moe_loss(dense_log) is None
