"""Newton-Schulz orthogonalization of whole matrices, also when they are sharded (FSDP2, HSDP, TP, EP).

Muon's update is the orthogonalized momentum, an odd matrix polynomial iterated on the WHOLE
matrix: orthogonalizing each shard alone gives a different (wrong) update. For a sharded update
(a DTensor) not every rank computes every matrix: each matrix gets one owner among the ranks of
its mesh (balanced by size), one all-to-all brings every shard of a matrix to its owner, the
owner orthogonalizes the matrices it owns, and a second all-to-all returns each rank its shard of
the result. Replicated mesh dimensions (HSDP's replicas) send one copy and receive the result on
every replica. Expert stacks (E, in, out) sharded only along the expert dimension (expert
parallelism, FSDP of a stack) already hold whole matrices, as do plain and replicated tensors:
those are orthogonalized where they are, per expert, with no communication.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cache

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic (torch.optim.Muon's defaults)
NS_EPS = 1e-7


def newton_schulz(update: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """The orthogonalization U S' V^T (S' ~ 1) of ``update`` (a matrix, or a stack over the leading dim), in ``dtype``.

    For a matrix the operations are exactly torch.optim.Muon's; a stack is normalized per matrix.
    """
    a, b, c = NS_COEFFICIENTS
    x = update.to(dtype)
    tall = update.size(-2) > update.size(-1)
    if tall:
        x = x.mT
    if x.ndim == 2:
        x = x / x.norm().clamp(min=NS_EPS)
        for _ in range(steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    else:
        x = x.reshape(-1, *x.shape[-2:])
        x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)
        for _ in range(steps):
            gram = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        x = x.reshape(*update.shape[:-2], *x.shape[-2:])
    return x.mT if tall else x


def shard_indices(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], coord: tuple[int, ...], placements: tuple[Placement, ...]
) -> list[torch.Tensor]:
    """Per tensor dimension, the global indices of the elements held by the rank at mesh ``coord``.

    Follows DTensor's left-to-right semantics: ``Shard`` keeps chunk ``coord`` (torch.chunk sizes,
    uneven and empty chunks included), ``_StridedShard`` (FSDP2 over TP) keeps piece ``coord`` of
    each of its ``split_factor`` groups, ``Replicate`` keeps everything.
    """
    indices = [torch.arange(n) for n in shape]
    for n, rank, placement in zip(mesh_shape, coord, placements):
        if isinstance(placement, _StridedShard):
            current = indices[placement.dim]
            groups = _chunk_bounds(len(current), int(placement.split_factor))
            pieces = []
            for start, end in groups:
                lo, hi = _chunk_bounds(end - start, n)[rank]
                pieces.append(current[start + lo : start + hi])
            indices[placement.dim] = torch.cat(pieces)
        elif isinstance(placement, Shard):
            lo, hi = _chunk_bounds(len(indices[placement.dim]), n)[rank]
            indices[placement.dim] = indices[placement.dim][lo:hi]
        elif not isinstance(placement, Replicate):
            raise TypeError(f"cannot orthogonalize a DTensor with placement {placement} (reduce it first)")
    return indices


def _chunk_bounds(length: int, chunks: int) -> list[tuple[int, int]]:
    """[start, end) of each of ``chunks`` torch.chunk pieces of ``length`` (trailing ones may be empty)."""
    size = -(-length // chunks) if length else 0
    return [(min(size * i, length), min(size * (i + 1), length)) for i in range(chunks)]


def holds_whole_matrices(update: torch.Tensor) -> bool:
    """Whether this rank's part of ``update`` is made of whole matrices (last two dims never sharded)."""
    if not isinstance(update, DTensor):
        return True
    dims = [p.dim for p in update.placements if isinstance(p, (Shard, _StridedShard))]
    return all(d % update.ndim < update.ndim - 2 for d in dims)


def orthogonalize(updates: list[torch.Tensor], steps: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Newton-Schulz of every update (plain tensors or DTensors); returns each rank's local part of each result.

    Collective over the ranks of every mesh that holds a matrix sharded along its last two dims:
    all of them must call it with the same updates in the same order.
    """
    results: list[torch.Tensor | None] = [None] * len(updates)
    sharded: dict[DeviceMesh, list[int]] = {}
    for i, update in enumerate(updates):
        if holds_whole_matrices(update):
            local = update.to_local() if isinstance(update, DTensor) else update
            results[i] = newton_schulz(local, steps, dtype)
        else:
            sharded.setdefault(update.device_mesh, []).append(i)
    for mesh, members in sharded.items():
        for i, result in zip(members, _orthogonalize_on_owners([updates[i] for i in members], mesh, steps, dtype)):
            results[i] = result
    return results  # type: ignore[return-value]


@dataclass
class _Unit:
    """One sharded matrix: its owner, and per rank of the group the indices it holds and whether it sends them."""

    shape: tuple[int, ...]
    owner: int
    blocks: list[list[torch.Tensor]]
    sends: list[bool]
    _on_device: dict[tuple[int, torch.device], tuple[torch.Tensor, ...]] = field(default_factory=dict)

    def numel(self, rank: int) -> int:
        return math.prod(len(ix) for ix in self.blocks[rank])

    def index(self, rank: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Advanced-indexing tuple selecting rank ``rank``'s block of the full matrix (kept on ``device``)."""
        if (rank, device) not in self._on_device:
            nd = len(self.shape)
            self._on_device[rank, device] = tuple(
                ix.to(device).view([-1 if d == k else 1 for d in range(nd)]) for k, ix in enumerate(self.blocks[rank])
            )
        return self._on_device[rank, device]


_GROUPS: dict[tuple[int, tuple[int, ...]], dist.ProcessGroup] = {}


def _flat_group(ranks: tuple[int, ...]) -> dist.ProcessGroup:
    """One process group over all ranks of a mesh (only its members create it), once per process group."""
    key = (id(dist.group.WORLD), ranks)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(ranks), use_local_synchronization=True)
    return _GROUPS[key]


@cache
def _plan(mesh: DeviceMesh, layouts: tuple[tuple[tuple[int, ...], tuple[Placement, ...]], ...]) -> list[_Unit]:
    """Owners (largest matrices first, each to the least loaded rank) and every rank's block of every matrix."""
    group = _flat_group(tuple(sorted(mesh.mesh.flatten().tolist())))
    coords = []
    for r in range(dist.get_world_size(group)):
        where = (mesh.mesh == dist.get_global_rank(group, r)).nonzero()[0]
        coords.append(tuple(where.tolist()))
    load = [0] * len(coords)
    owners = [0] * len(layouts)
    for i in sorted(range(len(layouts)), key=lambda i: -math.prod(layouts[i][0])):
        owners[i] = min(range(len(load)), key=lambda r: load[r])
        load[owners[i]] += math.prod(layouts[i][0])
    units = []
    for (shape, placements), owner in zip(layouts, owners):
        blocks = [shard_indices(shape, tuple(mesh.mesh.shape), c, placements) for c in coords]
        replicated = [d for d, p in enumerate(placements) if isinstance(p, Replicate)]
        units.append(_Unit(shape, owner, blocks, [all(c[d] == 0 for d in replicated) for c in coords]))
    return units


def _orthogonalize_on_owners(
    updates: list[DTensor], mesh: DeviceMesh, steps: int, dtype: torch.dtype
) -> list[torch.Tensor]:
    """Gather each sharded matrix on its owner (all-to-all), orthogonalize there, scatter the shards back."""
    units = _plan(mesh, tuple((tuple(u.shape), tuple(u.placements)) for u in updates))
    group = _flat_group(tuple(sorted(mesh.mesh.flatten().tolist())))
    me, n = dist.get_rank(group), dist.get_world_size(group)
    device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" else None
    locals_ = [u.to_local().to(device=device, dtype=dtype) for u in updates]
    device = locals_[0].device
    # 1. Every shard to the owner of its matrix.
    send = [[locals_[i].reshape(-1) for i, u in enumerate(units) if u.owner == d and u.sends[me]] for d in range(n)]
    got = _all_to_all(
        send, [[u.numel(s) for u in units if u.owner == me and u.sends[s]] for s in range(n)], group, dtype, device
    )
    # 2. The owner assembles and orthogonalizes its matrices.
    done: dict[int, torch.Tensor] = {}
    mine = [i for i, u in enumerate(units) if u.owner == me]
    for i in mine:
        full = torch.empty(units[i].shape, dtype=dtype, device=device)
        for s in range(n):
            if units[i].sends[s]:
                full[units[i].index(s, device)] = got[s].pop(0).view([len(ix) for ix in units[i].blocks[s]])
        done[i] = newton_schulz(full, steps, dtype)
    # 3. Every rank its block of every result.
    send = [[done[i][units[i].index(d, device)].reshape(-1) for i in mine] for d in range(n)]
    back = _all_to_all(send, [[u.numel(me) for u in units if u.owner == s] for s in range(n)], group, dtype, device)
    out = [back[u.owner].pop(0).view(locals_[i].shape) for i, u in enumerate(units)]
    return [o.to(u.to_local().device) for o, u in zip(out, updates)]


def _all_to_all(
    send: list[list[torch.Tensor]],
    recv_sizes: list[list[int]],
    group: dist.ProcessGroup,
    dtype: torch.dtype,
    device: torch.device,
) -> list[list[torch.Tensor]]:
    """One all_to_all_single of lists of flat tensors per peer; returns the received ones per peer, split."""
    flat = [t for peer in send for t in peer]
    payload = torch.cat(flat) if flat else torch.empty(0, dtype=dtype, device=device)
    out = torch.empty(sum(map(sum, recv_sizes)), dtype=dtype, device=device)
    dist.all_to_all_single(
        out, payload, [sum(p) for p in recv_sizes], [sum(t.numel() for t in peer) for peer in send], group=group
    )
    pieces = list(out.split([s for peer in recv_sizes for s in peer]))
    result, k = [], 0
    for peer in recv_sizes:
        result.append(pieces[k : k + len(peer)])
        k += len(peer)
    return result
