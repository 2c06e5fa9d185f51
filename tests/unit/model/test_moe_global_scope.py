"""MoE balancing over the global micro-batch: a batch split over simulated data-parallel ranks (threads
that sum through a barrier, standing in for the all-reduce that :mod:`tessera.parallel` installs) routes,
drops and balances exactly as one process holding the whole batch; the per-rank ("micro") scope does not.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from tessera.config import model_config
from tessera.model import MoELog
from tessera.model.moe import MoE, TokenGroup

RANKS = 4


def _moe(**kw) -> MoE:
    torch.manual_seed(0)
    cfg = model_config(vocab_size=300, dim=16, n_heads=2, moe_experts=4, moe_ffn_hidden=24, **kw)
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return moe


class _ThreadGroup:
    """``size`` threads that add a tensor over all of them (every thread must call, in the same order)."""

    def __init__(self, size: int) -> None:
        self.size, self.parts = size, [None] * size
        self.barrier = threading.Barrier(size)

    def member(self, rank: int) -> TokenGroup:
        def total(t: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = t.detach().clone()
            self.barrier.wait()
            out = sum(self.parts)
            self.barrier.wait()
            return out

        return TokenGroup(self.size, total, rank)


def _single(moe: MoE, x: torch.Tensor) -> tuple[float, torch.Tensor, torch.Tensor]:
    """(MoE loss, dropped fraction per expert, router gradient) of one process holding the whole batch."""
    moe.zero_grad()
    log = MoELog()
    out = moe(x, log)
    stats = log.layers[moe]
    (stats.loss + out.square().mean()).backward()
    return stats.loss.item(), stats.dropped_counts, moe.router.weight.grad.clone()


def _split(moe: MoE, x: torch.Tensor) -> tuple[float, torch.Tensor, torch.Tensor]:
    """The same over ``RANKS`` threads, each with its contiguous slice of the batch and its own copy of the layer:
    the mean of their losses and router gradients (the data-parallel average), the summed dropped counts."""
    group, copies = _ThreadGroup(RANKS), []
    results: list = [None] * RANKS
    for rank in range(RANKS):
        layer = copy.deepcopy(moe)
        layer.batch_group = group.member(rank)
        copies.append(layer)

    def run(rank: int) -> None:
        results[rank] = _single(copies[rank], x.chunk(RANKS)[rank])

    threads = [threading.Thread(target=run, args=(r,)) for r in range(RANKS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    losses, dropped, grads = zip(*results)
    return sum(losses) / RANKS, sum(dropped), sum(grads) / RANKS


@pytest.fixture
def batch() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(8, 6, 16)


@pytest.mark.parametrize(
    "options",
    [
        {"moe_top_k": 2, "moe_aux_loss_coef": 0.01, "moe_z_loss_coef": 0.001},  # Mixtral
        {"moe_top_k": 2, "moe_router": "softmax_topk", "moe_capacity_factor": 1.0},  # GShard: top-2 with dropping
        {"moe_top_k": 1, "moe_router": "softmax_topk", "moe_capacity_factor": 0.75},  # Switch
        {"moe_top_k": 2, "moe_aux_loss_scope": "sequence", "moe_router": "sigmoid"},  # DeepSeek
    ],
)
def test_global_scope_over_ranks_equals_one_process(options, batch):
    moe = _moe(**options)
    loss, dropped, grad = _single(moe, batch)
    got_loss, got_dropped, got_grad = _split(moe, batch)
    assert got_loss == pytest.approx(loss, rel=1e-6)
    assert torch.equal(got_dropped, dropped)  # the same assignments dropped, wherever their tokens live
    assert torch.allclose(got_grad, grad, rtol=1e-5, atol=1e-8)
    if moe.capacity_factor > 0:
        assert dropped.sum() > 0  # the capacity case must drop something to mean anything


def test_micro_scope_balances_each_rank_alone(batch):
    """The per-rank loss ("micro", Megatron/torchtitan's default) differs from the global-batch loss: the
    global test above would see a per-rank implementation."""
    options = {"moe_top_k": 2, "moe_aux_loss_coef": 0.01}
    moe = _moe(**options, moe_aux_loss_scope="micro")
    loss, _, _ = _single(moe, batch)
    micro_loss, _, _ = _split(moe, batch)
    assert abs(micro_loss - loss) > 1e-4 * abs(loss)


def test_token_group_gather_orders_by_rank():
    group = _ThreadGroup(3)
    out: list = [None] * 3

    def run(rank: int) -> None:
        out[rank] = group.member(rank).gather(torch.full((2,), float(rank)))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    want = torch.tensor([[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]])
    assert all(torch.equal(o, want) for o in out)
