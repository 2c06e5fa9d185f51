"""Deterministic, resumable, data-parallel-sharded batches, prepared ahead by a background thread.

The loader reads one endless stream of sample indices: pass ``e`` over a dataset of ``N``
samples visits all ``N`` once, in the dataset's own (already shuffled) order for ``e = 0`` and in
a permutation seeded by ``(seed, e)`` afterwards. Step ``s`` takes the global batch of
``batch_size * dp_size`` stream entries starting at ``consumed``; rank ``r`` gets the ``r``-th
slice (with ``chunks`` pipeline micro-batches, the ``r``-th slice of each of the ``chunks`` parts of
the global batch, so that pipeline micro-batch ``j`` of every rank together is the global batch's
``j``-th part, as gradient accumulation would split it). Batches may straddle passes, so across
ranks every sample of a pass is used exactly once and the position is just ``consumed``: resuming on any
data-parallel size continues at the same stream entry, with nothing repeated or skipped.

Every batch is a pure function of its stream position, so the prefetch thread computes the
next ``prefetch`` batches while the step runs without changing the order, and ``state_dict``
reports the position of the batches actually handed out.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np

from tessera.data.batch import Batch, Collate
from tessera.data.sources import DataError


class Samples(Protocol):
    """What the loader reads: a length and token windows by index."""

    seq_len: int

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> np.ndarray: ...


class SequenceLoader:
    """Yields this rank's :class:`Batch` of ``batch_size`` windows per step; see the module doc."""

    def __init__(
        self,
        dataset: Samples,
        batch_size: int,
        seed: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        collate: Collate | None = None,
        prefetch: int = 2,
        chunks: int = 1,
    ) -> None:
        if len(dataset) == 0:
            raise DataError(
                f"the training split has no sequences of {dataset.seq_len + 1} tokens; use more data or a shorter "
                "train.seq_len"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside 0..{dp_size - 1}")
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self.dp_rank, self.dp_size, self.chunks = dp_rank, dp_size, chunks
        self.global_batch = batch_size * dp_size
        self.collate = collate or Collate(eod=-1)
        self.prefetch = prefetch
        self.consumed = 0
        self._orders: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()
        self._pending: deque[Future] = deque()
        self._next_position = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tessera-prefetch") if prefetch > 0 else None

    def _order(self, epoch: int) -> np.ndarray:
        with self._lock:
            if epoch not in self._orders:
                n = len(self.dataset)
                order = np.arange(n) if epoch == 0 else np.random.default_rng([self.seed, epoch]).permutation(n)
                self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
                self._orders[epoch] = order
            return self._orders[epoch]

    def sample_ids(self, start: int, count: int) -> np.ndarray:
        """Dataset indices of stream entries ``start .. start + count``."""
        n = len(self.dataset)
        positions = np.arange(start, start + count)
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(positions // n):
            sel = positions // n == epoch
            out[sel] = self._order(int(epoch))[positions[sel] % n]
        return out

    def batch_at(self, consumed: int) -> Batch:
        """This rank's batch of the step that starts at global stream position ``consumed``."""
        size = self.batch_size // self.chunks  # a chunk's share: the j-th chunks of all ranks form global chunk j
        starts = [consumed + j * self.global_batch // self.chunks + self.dp_rank * size for j in range(self.chunks)]
        ids = np.concatenate([self.sample_ids(start, size) for start in starts])
        return self.collate([self.dataset[int(i)] for i in ids])

    def _fill(self) -> None:
        while len(self._pending) < self.prefetch:
            self._pending.append(self._pool.submit(self.batch_at, self._next_position))
            self._next_position += self.global_batch

    def next_batch(self) -> Batch:
        """This rank's next batch (prefetched in the background when ``prefetch`` > 0)."""
        if self._pool is None:
            batch = self.batch_at(self.consumed)
        else:
            if not self._pending:
                self._next_position = self.consumed
            self._fill()
            batch = self._pending.popleft().result()
            self._fill()
        self.consumed += self.global_batch
        return batch

    def __iter__(self) -> Iterator[Batch]:
        while True:
            yield self.next_batch()

    @property
    def epoch(self) -> int:
        """The pass over the dataset the next batch starts in."""
        return self.consumed // len(self.dataset)

    def state_dict(self) -> dict[str, Any]:
        """Position in the sample stream (plain ints, JSON-safe): global samples consumed and the seed."""
        return {"consumed": self.consumed, "seed": self.seed, "samples": len(self.dataset)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position (any data-parallel size); a different dataset is an error."""
        if int(state["samples"]) != len(self.dataset):
            raise DataError(
                f"the loader state was saved over {state['samples']} samples but this dataset has "
                f"{len(self.dataset)}; resume with the same data config"
            )
        self._drop_pending()
        self.consumed, self.seed = int(state["consumed"]), int(state["seed"])
        with self._lock:
            self._orders.clear()

    def _drop_pending(self) -> None:
        for future in self._pending:
            future.cancel()
        for future in self._pending:
            if not future.cancelled():
                future.exception()  # wait; a failed prefetch is irrelevant once discarded
        self._pending.clear()

    def close(self) -> None:
        """Stop the prefetch thread."""
        self._drop_pending()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
