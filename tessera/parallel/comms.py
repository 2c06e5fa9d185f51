"""Counting the collectives a region of code issues (what DTensor sends), for tests and benchmarks."""

from __future__ import annotations

from collections import Counter
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

COLLECTIVES = frozenset(
    {"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast"}
)


class CollectiveCounter(TorchDispatchMode):
    """``with CollectiveCounter() as c: ...`` then ``c.counts`` (name -> calls) and ``c.kib``
    (name -> KiB sent, last call)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.kib: dict[str, float] = {}

    def __torch_dispatch__(self, func, types, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None):
        out = func(*args, **(kwargs or {}))
        name = func._overloadpacket.__name__
        if func.namespace == "_c10d_functional" and name in COLLECTIVES:
            self.counts[name] += 1
            self.kib[name] = args[0].numel() * args[0].element_size() / 1024
        return out
