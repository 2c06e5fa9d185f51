"""With pipeline micro-batches, micro-batch j of every data-parallel rank together is the global batch's
j-th part (what gradient accumulation would give one process), so MoE balancing over the dp ranks of a
pipeline micro-batch equals one process accumulating those parts."""

from __future__ import annotations

import numpy as np

from tessera.data.loader import SequenceLoader

SEQ = 4


class Numbered:
    """Sample ``i`` is the window ``[i, i, ..., i]``."""

    seq_len = SEQ

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(SEQ + 1, i, dtype=np.int64)


def test_pipeline_micro_batch_j_of_all_ranks_is_the_global_batchs_jth_part():
    dp, per_rank, chunks = 2, 4, 2
    loaders = [SequenceLoader(Numbered(), per_rank, 0, r, dp, prefetch=0, chunks=chunks) for r in range(dp)]
    for _ in range(3):
        rows = [loader.next_batch().tokens[:, 0].tolist() for loader in loaders]
        start = min(min(r) for r in rows)
        size = per_rank // chunks
        for j in range(chunks):  # the schedule splits each rank's batch into contiguous chunks
            together = sorted(x for r in rows for x in r[j * size : (j + 1) * size])
            assert together == list(range(start + j * dp * size, start + (j + 1) * dp * size))
    plain = SequenceLoader(Numbered(), per_rank, 0, 0, 1, prefetch=0, chunks=chunks)
    assert plain.next_batch().tokens[:, 0].tolist() == [0, 1, 2, 3]  # one rank: unchanged
