"""SequenceLoader: dp sharding, determinism, exact resume (same and different dp size), prefetch, document masks."""

from __future__ import annotations

import time
import warnings

import numpy as np
import pytest
import torch

from tessera.data.batch import Collate, document_tensors
from tessera.data.loader import SequenceLoader
from tessera.data.sources import DataError

SEQ = 8


class Numbered:
    """Sample ``i`` is the window ``[i, i, ..., i]``, so batches say which samples they hold."""

    seq_len = SEQ

    def __init__(self, n: int, delay: float = 0.0) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        if self.delay:
            time.sleep(self.delay)
        return np.full(SEQ + 1, i, dtype=np.int64)


def _ids(batch) -> list[int]:
    return batch.tokens[:, 0].tolist()


def _global_steps(loaders: list[SequenceLoader], steps: int) -> list[int]:
    """Samples of ``steps`` global batches, rank 0's slice first (the order of the global batch)."""
    out: list[int] = []
    for _ in range(steps):
        for loader in loaders:
            out += _ids(loader.next_batch())
    return out


def _ranks(n: int, batch: int, dp: int, seed: int = 5, prefetch: int = 2) -> list[SequenceLoader]:
    return [SequenceLoader(Numbered(n), batch, seed, rank, dp, prefetch=prefetch) for rank in range(dp)]


def test_ranks_see_every_sample_of_an_epoch_exactly_once():
    n, batch, dp = 50, 3, 4  # 12 per global batch; epochs end mid-batch
    stream = _global_steps(_ranks(n, batch, dp), 13)  # 156 samples > 3 epochs
    for epoch in range(3):
        assert sorted(stream[epoch * n : (epoch + 1) * n]) == list(range(n))
    assert stream[:n] != stream[n : 2 * n]  # reshuffled between epochs
    assert stream == _global_steps(_ranks(n, batch, dp), 13)  # deterministic from the seed
    assert stream == _global_steps(_ranks(n, batch * dp, 1), 13)  # the same stream as one rank
    assert stream != _global_steps(_ranks(n, batch, dp, seed=6), 13)


def test_resume_on_the_same_layout_is_exact():
    uninterrupted = _global_steps(_ranks(50, 4, 2), 9)
    first = _ranks(50, 4, 2)
    head = _global_steps(first, 4)
    states = [loader.state_dict() for loader in first]
    assert states[0] == states[1] == {"consumed": 32, "seed": 5, "samples": 50}
    resumed = _ranks(50, 4, 2)
    for loader, state in zip(resumed, states):
        loader.load_state_dict(state)
    assert head + _global_steps(resumed, 5) == uninterrupted


@pytest.mark.parametrize("old_dp,new_dp", [(4, 2), (2, 3), (1, 4)])
def test_resume_on_a_different_dp_size_continues_at_the_same_sample(old_dp, new_dp):
    per_rank = 12 // old_dp, 12 // new_dp  # the same global batch of 12
    reference = _global_steps(_ranks(50, 12, 1), 10)
    before = _ranks(50, per_rank[0], old_dp)
    head = _global_steps(before, 4)
    after = _ranks(50, per_rank[1], new_dp)
    for loader in after:
        loader.load_state_dict(before[0].state_dict())
    assert head + _global_steps(after, 6) == reference  # nothing repeated, nothing skipped


def test_resume_with_a_different_global_batch_keeps_the_sample_position():
    before = _ranks(50, 6, 2)
    head = _global_steps(before, 3)  # 36 samples
    after = _ranks(50, 5, 1)
    after[0].load_state_dict(before[1].state_dict())
    assert head + _global_steps(after, 4) == _global_steps(_ranks(50, 56, 1), 1)


def test_state_dict_counts_handed_out_batches_not_prefetched_ones():
    loader = SequenceLoader(Numbered(40), 4, 1, prefetch=3)
    sync = SequenceLoader(Numbered(40), 4, 1, prefetch=0)
    for step in range(1, 6):
        assert _ids(loader.next_batch()) == _ids(sync.next_batch())
        assert loader.state_dict()["consumed"] == 4 * step
    loader.load_state_dict({"consumed": 8, "seed": 1, "samples": 40})
    sync.load_state_dict({"consumed": 8, "seed": 1, "samples": 40})
    assert _ids(loader.next_batch()) == _ids(sync.next_batch())
    with pytest.raises(DataError, match="saved over 41 samples but this dataset has 40"):
        loader.load_state_dict({"consumed": 8, "seed": 1, "samples": 41})
    loader.close()


class Recording(Numbered):
    """Numbered samples that remember which were read (by any thread)."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.read: list[int] = []

    def __getitem__(self, i: int) -> np.ndarray:
        self.read.append(i)
        return super().__getitem__(i)


def test_prefetch_reads_ahead_in_the_background_without_changing_order():
    dataset = Recording(100)
    loader = SequenceLoader(dataset, 4, 0, prefetch=2)
    first = _ids(loader.next_batch())
    deadline = time.monotonic() + 10
    while len(dataset.read) < 3 * 4 and time.monotonic() < deadline:  # the batch taken + 2 prefetched
        time.sleep(0.01)
    ahead = list(dataset.read[4:12])
    assert len(ahead) == 8, "the loader did not read the next two batches before they were asked for"
    second, third = _ids(loader.next_batch()), _ids(loader.next_batch())
    loader.close()
    assert sorted(second + third) == sorted(ahead)
    plain = SequenceLoader(Numbered(100), 4, 0, prefetch=0)
    assert [_ids(plain.next_batch()) for _ in range(3)] == [first, second, third]
    plain.close()


def test_empty_dataset_is_a_data_error():
    with pytest.raises(DataError, match="no sequences"):
        SequenceLoader(Numbered(0), 4, 0)


def _megatron_masks(tokens: torch.Tensor, eod: int):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids
    return _get_ltor_masks_and_position_ids(tokens, eod, True, True, True, True)


def test_document_tensors_match_megatrons_reset_masks():
    eod = 3
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 9, (4, 33), generator=gen)  # many EODs, including at the edges
    tokens[0, 0], tokens[1, 31] = eod, eod
    batch = Collate(eod, document_mask=True, mask_eod_loss=True)([row.numpy() for row in tokens])
    inputs = tokens[:, :-1]
    assert batch.model_kwargs().keys() == {"positions", "document_ids"}
    for row in range(4):
        attention, loss_mask, positions = _megatron_masks(inputs[row].clone(), eod)
        assert torch.equal(batch.positions[row], positions)
        assert torch.equal(batch.loss_mask[row], loss_mask.bool())
        ids = batch.document_ids[row]
        allowed = (ids[:, None] == ids[None, :]) & torch.ones(32, 32, dtype=torch.bool).tril()
        assert torch.equal(allowed, ~attention[0])  # megatron's mask marks blocked pairs
    plain = Collate(eod)([row.numpy() for row in tokens])
    assert plain.positions is None and plain.loss_mask is None and plain.model_kwargs() == {}
    positions, doc_ids = document_tensors(torch.tensor([[5, 3, 5, 5, 3, 3, 5]]), eod)
    assert positions.tolist() == [[0, 1, 0, 1, 2, 0, 0]] and doc_ids.tolist() == [[0, 0, 1, 1, 1, 2, 3]]
