"""shard_batch: each tensor of a batch is cut along its own length (an encoder-decoder's two sequences)."""

from __future__ import annotations

import pytest
import torch

from tessera.parallel.context import shard_batch, zigzag_index


class _Mesh:
    """The two things shard_batch asks of a cp mesh."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return self._rank


def test_encoder_and_decoder_sequences_are_cut_along_their_own_lengths():
    enc, dec = torch.arange(2 * 56).view(2, 56), torch.arange(2 * 12).view(2, 12)
    for rank in range(2):
        (e, d), _, labels, mask = shard_batch((enc, dec), {}, dec.clone(), None, _Mesh(2, rank))
        assert torch.equal(e, enc[:, zigzag_index(56, 2, rank)]) and torch.equal(d, dec[:, zigzag_index(12, 2, rank)])
        assert torch.equal(labels, d) and mask is None


def test_a_length_that_does_not_cut_into_2cp_chunks_is_refused():
    with pytest.raises(ValueError, match="13 tokens"):
        shard_batch((torch.zeros(2, 13),), {}, torch.zeros(2, 12), None, _Mesh(2, 0))
