"""Token-level scoring of a decoder for downstream tasks, sharded over data-parallel ranks.

Each request is scored alone (batch of one, no padding), so a request's numbers do not depend on which
rank scored it or what else was in its batch: results are equal across rank layouts. Requests are dealt
round-robin over the ``dp_size`` ranks (every tensor-parallel rank of one data-parallel index runs the same
forwards, the model's normal ones); each rank fills its rows and a sum over the data-parallel ranks
(``reduce``) gives every rank every row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

Reduce = Callable[[list[float]], list[float]]


def _no_reduce(values: list[float]) -> list[float]:
    return values


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (tensor-parallel logits), else the tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@dataclass
class Scorer:
    """Scores token sequences with ``model`` (logits = ``model(ids)``) on ``device``; this rank is ``dp_rank``
    of ``dp_size`` and ``reduce`` sums a list of floats over the data-parallel ranks."""

    model: nn.Module
    device: torch.device
    max_len: int
    dp_rank: int = 0
    dp_size: int = 1
    reduce: Reduce = _no_reduce
    autocast: Callable | None = None

    def _mine(self, n: int) -> list[tuple[int, bool]]:
        """(request, keep) for this rank: every rank runs the same number of forwards (FSDP gathers weights
        collectively in each), so a rank short of a request repeats request 0 and drops the result."""
        rounds = -(-n // self.dp_size)
        picks = (self.dp_rank + k * self.dp_size for k in range(rounds))
        return [(i, True) if i < n else (0, False) for i in picks]

    def _logits(self, ids: list[int]) -> torch.Tensor:
        x = torch.tensor([ids], device=self.device)
        if self.autocast is not None:
            with self.autocast():
                return _local(self.model(x))[0].float()
        return _local(self.model(x))[0].float()

    def _loglikelihood(self, context: Sequence[int], continuation: Sequence[int]) -> tuple[float, bool]:
        whole = (list(context) + list(continuation))[-(self.max_len + 1) :]
        n = len(continuation)
        logits = self._logits(whole[:-1])[-n:]
        target = torch.tensor(whole[-n:], device=logits.device)
        logprobs = F.log_softmax(logits, dim=-1)
        total = logprobs.gather(1, target[:, None]).sum()
        greedy = bool((logits.argmax(-1) == target).all())
        return float(total.double()), greedy

    @torch.no_grad()
    def loglikelihoods(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether it is the greedy continuation) for each pair."""
        was_training = self.model.training
        self.model.eval()
        rows = [0.0] * (2 * len(pairs))
        try:
            for i, keep in self._mine(len(pairs)):
                logprob, greedy = self._loglikelihood(*pairs[i])
                if keep:
                    rows[2 * i], rows[2 * i + 1] = logprob, float(greedy)
        finally:
            self.model.train(was_training)
        rows = self.reduce(rows)
        return [(rows[2 * i], rows[2 * i + 1] > 0.5) for i in range(len(pairs))]

    def _greedy_one(self, prompt: list[int], max_new: int) -> list[int]:
        """``max_new`` greedy tokens, each from a full forward of the sequence so far: no decoding cache, so the
        model's normal forward serves every layout (a tensor-parallel model's caches would hold local heads)."""
        ids = list(prompt)
        for _ in range(max_new):
            ids.append(int(self._logits(ids)[-1].argmax()))
        return ids[len(prompt) :]

    @torch.no_grad()
    def greedy(self, prompts: Sequence[Sequence[int]], max_new: int, eos_id: int | None) -> list[list[int]]:
        """Greedy continuations of ``max_new`` tokens each (cut at EOS), prompts left-truncated to fit the context.

        Always ``max_new`` decoding steps, EOS or not: every rank then runs the same forwards (see ``_mine``)."""
        max_new = min(max_new, self.max_len - 1)
        width = max_new + 1  # slot 0: the length; then the tokens, each stored as id + 1 (0 = empty)
        rows = [0.0] * (width * len(prompts))
        was_training = self.model.training
        self.model.eval()
        try:
            for i, keep in self._mine(len(prompts)):
                out = self._greedy_one(list(prompts[i])[-(self.max_len - max_new) :], max_new)
                out = out[: out.index(eos_id)] if eos_id in out else out
                if keep:
                    rows[i * width] = float(len(out))
                    rows[i * width + 1 : i * width + 1 + len(out)] = [float(t + 1) for t in out]
        finally:
            self.model.train(was_training)
        rows = self.reduce(rows)
        result = []
        for i in range(len(prompts)):
            n = int(rows[i * width])
            result.append([int(t) - 1 for t in rows[i * width + 1 : i * width + 1 + n]])
        return result
