"""Deterministic, resumable, data-parallel-sharded batches of packed sequences."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tessera.data.dataset import PackedSequences


class SequenceLoader:
    """Yields (batch_size, seq_len + 1) token tensors, reshuffled every epoch from ``seed``.

    Each global batch holds ``batch_size * dp_size`` samples of one epoch's permutation; rank
    ``r`` gets the ``r``-th slice, so across ranks every sample of an epoch is used once. The
    position is ``(epoch, consumed)``; ``state_dict`` saves it and a resumed loader continues
    with exactly the samples an uninterrupted one would have produced.
    """

    def __init__(self, dataset: PackedSequences, batch_size: int, seed: int, dp_rank: int = 0, dp_size: int = 1, shuffle: bool = True) -> None:
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self.dp_rank, self.dp_size, self.shuffle = dp_rank, dp_size, shuffle
        self.global_batch = batch_size * dp_size
        if len(dataset) < self.global_batch:
            from tessera.data.sources import DataError

            raise DataError(
                f"the dataset has {len(dataset)} sequences of {dataset.seq_len} tokens, fewer than one batch of {self.global_batch}; "
                "use more data, a shorter train.seq_len or a smaller train.batch_size"
            )
        self.epoch, self.consumed = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.dataset))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))

    def next_batch(self) -> torch.Tensor:
        """This rank's next batch; starts a new epoch when the current one cannot fill a batch."""
        if self.consumed + self.global_batch > len(self.dataset):
            self.epoch, self.consumed = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        lo = self.consumed + self.dp_rank * self.batch_size
        ids = self._order[lo : lo + self.batch_size]
        self.consumed += self.global_batch
        return torch.from_numpy(np.stack([self.dataset[int(i)] for i in ids]))

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """Position in the sample stream (plain ints, JSON-safe)."""
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position."""
        self.epoch, self.consumed, self.seed = int(state["epoch"]), int(state["consumed"]), int(state["seed"])
        self._order = self._permutation(self.epoch)
