"""Parameters that several pipeline stages use: a tied embedding and head, a score-bias table.

Each pp rank that runs such a stage holds a copy. The copies start equal (every rank builds
the same model) and stay equal because their gradients are summed over those ranks before the
optimizer step (Megatron's embedding group); the gradient norm counts them once. Every rank's
local model names the parameter under all of its uses, so its checkpoint keys (and the
optimizer's) are those of the unsplit model.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from tessera.layout import stage_rank


@dataclass
class SharedParameter:
    """One parameter used by the stages of several pp ranks."""

    uses: list[tuple[nn.Module, str]]  # (module, attribute) of every use, in the full model
    ranks: list[int]  # the pp ranks whose stages use it, ascending
    group: dist.ProcessGroup | None = None  # those ranks, for this rank's other mesh coordinates

    def live(self) -> torch.Tensor:
        """This rank's copy: the one a parallelized stage holds (FSDP/TP replaced the others)."""
        params = [getattr(module, attr) for module, attr in self.uses]
        return next((p for p in params if isinstance(p, DTensor)), params[0])


def find_shared(stage_models: dict[int, nn.Module], pp: int, schedule: str = "1f1b") -> list[SharedParameter]:
    """The parameters that stages on different pp ranks use (stage ``s`` runs on rank
    :func:`~tessera.layout.stage_rank`: ``s % pp`` looped, in a V for the V schedules)."""
    uses: dict[int, list[tuple[nn.Module, str]]] = defaultdict(list)
    ranks: dict[int, set[int]] = defaultdict(set)
    for stage_id, model in stage_models.items():
        for module in model.modules():
            for attr, param in module.named_parameters(recurse=False):
                if (module, attr) not in uses[id(param)]:
                    uses[id(param)].append((module, attr))
                ranks[id(param)].add(stage_rank(stage_id, pp, schedule))
    return [SharedParameter(uses[key], sorted(ranks[key])) for key in uses if len(ranks[key]) > 1]


def make_groups(shared: list[SharedParameter], mesh: object, pp_group: dist.ProcessGroup) -> None:
    """Give each shared parameter the process group of its ranks (collective: every rank calls it
    with the same list, built from the same model)."""
    pp_size = dist.get_world_size(pp_group)
    rows = None
    for param in shared:
        if len(param.ranks) == pp_size:
            param.group = pp_group
            continue
        if rows is None:  # every pp group of the world: the mesh with its pp dimension last
            pp_dim = mesh.mesh_dim_names.index("pp")
            rows = mesh.mesh.movedim(pp_dim, -1).reshape(-1, pp_size).tolist()
        param.group, _ = dist.new_subgroups_by_enumeration([[row[r] for r in param.ranks] for row in rows])


def tie_local_uses(shared: list[SharedParameter], local: nn.Module) -> None:
    """Point every use in ``local`` at this rank's live copy (after the stages are parallelized)."""
    present = {id(m) for m in local.modules()}
    for param in shared:
        live = param.live()
        for module, attr in param.uses:
            if id(module) in present and getattr(module, attr) is not live:
                setattr(module, attr, live)


@torch.no_grad()
def reduce_shared_grads(shared: list[SharedParameter]) -> None:
    """Sum each shared parameter's gradient over the ranks that hold a copy."""
    for param in shared:
        live = param.live()
        grad = live.grad
        if grad is None or param.group is None:
            continue
        if isinstance(grad, DTensor) and grad.placements != live.placements:
            # A vocab-sharded embedding's gradient comes back replicated: its copies must hold the same shard.
            grad = live.grad = grad.redistribute(live.device_mesh, live.placements)
        dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=param.group)


def norm_duplicates(shared: list[SharedParameter], pp_rank: int) -> list[torch.Tensor]:
    """The copies the global gradient norm must skip on this rank (all but the lowest rank's)."""
    return [param.live() for param in shared if pp_rank in param.ranks and pp_rank != param.ranks[0]]
