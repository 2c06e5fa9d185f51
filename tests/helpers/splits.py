"""A RecurrentSplit whose pieces are all in this process, in sequence order: what context parallelism computes
across ranks (tessera/parallel/context.py), checked against the unsplit forward without a process group."""

from __future__ import annotations

import torch


class InOrderSplit:
    """``n`` contiguous pieces; ``drop_state`` / ``drop_halo`` break the exchange on purpose (the tests that
    must fail without it)."""

    def __init__(self, n: int, drop_state: bool = False, drop_halo: bool = False) -> None:
        self.n, self.drop_state, self.drop_halo = n, drop_state, drop_halo

    def pieces(self, length: int) -> list[slice]:
        size = length // self.n
        return [slice(i * size, (i + 1) * size) for i in range(self.n)]

    def halos(self, tails: torch.Tensor) -> torch.Tensor:
        before = torch.cat([torch.zeros_like(tails[:, :, :1]), tails[:, :, :-1]], dim=2)
        return torch.zeros_like(before) if self.drop_halo else before

    def entering_states(
        self, transitions: torch.Tensor, contributions: torch.Tensor, elementwise: bool = False
    ) -> torch.Tensor:
        state, out = torch.zeros_like(contributions[0]), []
        for a, h in zip(transitions, contributions):
            out.append(state)
            state = (a * state if elementwise else a @ state) + h
        return torch.zeros_like(torch.stack(out)) if self.drop_state else torch.stack(out)

    def maximum(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach()  # every piece is here: the local maximum is the sequence's
