"""Mixture of experts: routing equals a per-token reference, capacity drops, aux/z losses, stats."""

from __future__ import annotations

import json
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
    cfg = model_config(
        vocab_size=300,
        dim=32,
        n_layers=4,
        n_heads=4,
        moe_experts=4,
        moe_every=2,
        moe_shared_experts=1,
        moe_z_loss_coef=0.01,
    )
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
    build_model(model_config(vocab_size=300, dim=32, n_layers=1, n_heads=4))(
        torch.randint(0, 300, (2, 8)), moe_log=dense_log
    )
    assert moe_loss(dense_log) is None


def _deepseek(**kw) -> MoE:
    """Sigmoid scores, 4 groups of 2 experts of which 2 are searched, a non-zero balancing bias."""
    torch.manual_seed(0)
    cfg = model_config(
        vocab_size=300,
        dim=16,
        n_heads=2,
        moe_experts=8,
        moe_ffn_hidden=24,
        moe_top_k=3,
        moe_router="sigmoid",
        moe_groups=4,
        moe_topk_groups=2,
        moe_bias_update_rate=0.1,
        moe_route_scale=2.5,
        **kw,
    )
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    moe.expert_bias.copy_(torch.linspace(-0.2, 0.2, 8))
    return moe


def test_sigmoid_group_limited_routing_matches_a_per_token_reference():
    moe = _deepseek()
    x = torch.randn(12, 16)
    weights, ids, scores = moe.route(moe.router(x).float())
    for n in range(12):
        s = torch.sigmoid(moe.router(x[n]).float())
        biased = s + moe.expert_bias
        group_scores = [sorted(biased[g * 2 : g * 2 + 2].tolist())[-2:] for g in range(4)]
        best_groups = sorted(range(4), key=lambda g: -sum(group_scores[g]))[:2]
        allowed = [e for e in range(8) if e // 2 in best_groups]
        chosen = sorted(allowed, key=lambda e: -biased[e].item())[:3]
        assert ids[n].tolist() == chosen  # chosen by the biased scores, best first, in the best groups only
        want = s[chosen] / s[chosen].sum() * 2.5  # weighted by the unbiased scores, normalized, scaled
        assert torch.allclose(weights[n], want, atol=1e-6)
    assert torch.allclose(scores, torch.sigmoid(moe.router(x).float()))


def test_grouped_matmul_and_loop_paths_agree_in_bf16(monkeypatch):
    results = []
    cases = [("swiglu", 0.0), ("swiglu", 0.75), ("gelu", 0.75)]  # gated and plain experts, dropless and dropping
    for grouped in (True, False):
        monkeypatch.setattr("tessera.model.moe.uses_grouped_mm", lambda x, g=grouped: g and x.shape[0] > 0)
        for activation, capacity in cases:
            torch.manual_seed(0)
            cfg = model_config(
                vocab_size=300,
                dim=16,
                n_heads=2,
                activation=activation,
                moe_experts=4,
                moe_ffn_hidden=24,
                moe_capacity_factor=capacity,
            )
            moe = MoE(cfg).to(torch.bfloat16)
            for p in moe.parameters():
                torch.nn.init.normal_(p, std=0.3)
            x = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).requires_grad_()
            log = MoELog()
            out = moe(x, log)
            (out.float().pow(2).sum() + moe_loss(log)).backward()
            assert (log.layers[moe].dropped.item() > 0) == (capacity > 0)  # dropped rows must come back as zeros
            results.append([out, x.grad, *(p.grad for p in moe.parameters())])
    for grouped, loop in zip(results[: len(cases)], results[len(cases) :]):
        for a, b in zip(grouped, loop):
            torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


def test_no_host_sync_in_the_bf16_forward_and_backward():
    """Under FakeTensorMode any read of a tensor's values (``.item()``, ``.tolist()``, data-dependent
    shapes) raises: the bf16 (grouped) path passes, the fp32 loop path reads the group sizes."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        FakeTensorMode,
    )

    for dtype in (torch.bfloat16, torch.float32):
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with FakeTensorMode():
                moe = _deepseek(
                    moe_capacity_factor=1.0, moe_shared_experts=1, moe_shared_gate=True, moe_aux_loss_scope="sequence"
                )
                log = MoELog()
                if dtype == torch.float32:
                    with pytest.raises(DataDependentOutputException):
                        moe(torch.randn(2, 5, 16), log)
                    continue
                out = moe(torch.randn(2, 5, 16), log)
                (out.float().sum() + moe_loss(log)).backward()
        finally:
            torch.set_default_dtype(default)


def test_sequence_aux_loss_shared_gate_and_dense_first_layers():
    moe = _moe(moe_top_k=2, moe_aux_loss_scope="sequence", moe_shared_experts=1, moe_shared_gate=True)
    with torch.no_grad():
        moe.router.weight.zero_()
    log = MoELog()
    x = torch.randn(3, 4, 16)
    out = moe(x, log)
    assert log.layers[moe].aux_loss.item() == pytest.approx(1.0)  # DeepSeek's f is E/(kT) x count: 1 when uniform
    with torch.no_grad():
        moe.experts.down_proj.zero_()
    gated = torch.sigmoid(moe.shared_gate(x)) * moe.shared(x)
    assert torch.allclose(moe(x), gated, atol=1e-6) and not torch.allclose(out, gated)
    cfg = model_config(
        vocab_size=300, dim=32, n_layers=4, n_heads=4, moe_experts=4, moe_first_dense=1, moe_shared_ffn_hidden=40
    )
    model = build_model(cfg)
    assert [layer.moe is not None for layer in model.layers.values()] == [False, True, True, True]
    assert model.layers["1"].moe.shared is None and model.layers["1"].moe.shared_gate is None
    cfg = model_config(
        vocab_size=300, dim=32, n_layers=2, n_heads=4, moe_experts=4, moe_shared_experts=2, moe_shared_ffn_hidden=40
    )
    assert build_model(cfg).layers["0"].moe.shared.up_proj.weight.shape == (40, 32)


def test_aux_free_bias_steers_choices_not_weights_and_moves_towards_balance(tmp_path):
    from tessera.train.moe_stats import ExpertLoadTracker

    cfg = model_config(
        vocab_size=300,
        dim=32,
        n_layers=2,
        n_heads=4,
        moe_experts=4,
        moe_top_k=1,
        moe_router="sigmoid",
        moe_bias_update_rate=0.05,
    )
    model = build_model(cfg)
    moe = model.layers["0"].moe
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[3] = 0.5  # expert 3 takes (nearly) every token
    tracker = ExpertLoadTracker(cfg, model, torch.device("cpu"))
    log = MoELog()
    model(torch.randint(0, 300, (2, 16)), moe_log=log)
    metrics = tracker.step([log])
    load = metrics["moe_expert_load"][0]
    assert len(metrics["moe_expert_load"]) == 2 and sum(load) == pytest.approx(1.0)
    assert metrics["moe_imbalance"] == pytest.approx((max(load) * 4 + max(metrics["moe_expert_load"][1]) * 4) / 2)
    overloaded = max(range(4), key=lambda e: load[e])
    assert moe.expert_bias[overloaded].item() == pytest.approx(-0.05)  # above the mean load: down
    assert all(moe.expert_bias[e].item() == pytest.approx(0.05) for e in range(4) if load[e] < 0.25)  # below: up
    with torch.no_grad():
        moe.expert_bias.copy_(torch.tensor([5.0, 0.0, 0.0, 0.0]))
    weights, ids, _ = moe.route(torch.randn(6, 4))
    assert (ids[:, 0] == 0).all() and torch.allclose(
        weights[:, 0], torch.ones(6)
    )  # chosen by the bias, weight unbiased
    report = tracker.finish(tmp_path, write=True)
    assert "layers.0.moe" in report and "imbalance" in report
    saved = json.loads((tmp_path / "expert_load.json").read_text())["layers"]
    assert [layer["layer"] for layer in saved] == ["layers.0.moe", "layers.1.moe"]
    assert sum(saved[0]["assignments"]) == 2 * 16  # top-1 over 32 tokens


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.moe.experts=6", "model.moe.groups=4"], "must divide model.moe.experts"),
        (
            ["model.moe.experts=8", "model.moe.groups=4", "model.moe.topk_groups=1", "model.moe.top_k=3"],
            "cannot hold top_k",
        ),
        (["model.moe.experts=4", "model.moe.shared_gate=true"], "set model.moe.shared_experts > 0"),
        (["parallel.ep=2"], "the model has none"),
        (["model.moe.experts=6", "parallel.ep=4"], "not divisible by parallel.ep=4"),
        (
            ["model.moe.experts=4", "parallel.ep=2", "parallel.tp=4", "model.n_heads=4", "model.n_kv_heads=4"],
            r"multiple of cp\*tp=4",
        ),
        (["model.moe.experts=4", "parallel.ep=4", "parallel.dp_shard=2"], r"must divide dp_shard\*cp\*tp=2"),
    ],
)
def test_moe_and_expert_parallel_config_errors(tiny_config, overrides, message):
    from tessera.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        tiny_config(*overrides)
