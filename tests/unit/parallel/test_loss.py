"""The one loss of a micro-batch (parallel/loss.py) and the pipeline's stage-to-stage metadata."""

from __future__ import annotations

import pytest
import torch

from tessera.parallel.loss import LossWeights, MicroBatch, combine_losses, moe_aux_weight
from tessera.parallel.pipeline import StageTail


def test_combine_losses_weighs_each_term_once():
    main, mtp, aux = torch.tensor(2.0), [torch.tensor(1.0), torch.tensor(3.0)], torch.tensor(0.25)
    loss = combine_losses(main, LossWeights(0.5, 0.3), mtp, aux)
    assert loss.item() == pytest.approx(2.0 * 0.5 + 0.3 / 2 * (1.0 + 3.0) + 0.25)
    assert combine_losses(main, LossWeights()).item() == 2.0
    distilled = combine_losses(main, LossWeights(0.5), distill=lambda loss: loss * 10)
    assert distilled.item() == pytest.approx(10.0)  # distillation sees the weighted token loss


def test_moe_losses_weigh_one_over_the_forwards_of_a_step():
    assert moe_aux_weight(4) == 0.25 and moe_aux_weight(2, 3) == pytest.approx(1 / 6)


def test_a_micro_batch_counts_its_loss_tokens_and_moves_whole():
    labels = torch.ones(2, 4, dtype=torch.long)
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])
    batch = MicroBatch.of(((labels,), {"positions": labels}, labels, mask))
    assert int(batch.tokens()) == 3 and MicroBatch((labels,), {}, labels).tokens() == 8
    moved = batch.to(torch.device("meta"))
    assert moved.args[0].is_meta and moved.kwargs["positions"].is_meta and moved.loss_mask.is_meta


def test_stage_tail_unpacks_what_it_packs():
    documents = (torch.arange(4), torch.zeros(4))
    tail = StageTail(documents, targets=torch.ones(2, 4, 2), embedded=torch.full((2, 4, 8), 3.0))
    back = StageTail.unpack(tail.pack(), targets=True, embedded=True)
    assert all(torch.equal(a, b) for a, b in zip(back.documents, documents))
    assert torch.equal(back.targets, tail.targets) and torch.equal(back.embedded, tail.embedded)
    bare = StageTail.unpack(StageTail(documents).pack(), targets=False, embedded=False)
    assert bare.targets is None and bare.embedded is None and len(bare.documents) == 2
