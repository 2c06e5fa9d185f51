"""Global-norm gradient clipping over a mix of DTensor (any mesh) and plain-tensor gradients."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


def _group_key(p: torch.Tensor) -> tuple:
    if isinstance(p, DTensor):
        return ("dtensor", p.device_mesh, p.dtype)
    return ("tensor", p.device, p.dtype)


def _grouped(parameters: Iterable[torch.nn.Parameter]) -> dict[tuple, list[torch.nn.Parameter]]:
    groups: dict[tuple, list[torch.nn.Parameter]] = defaultdict(list)
    for p in parameters:
        if p.grad is not None:
            groups[_group_key(p)].append(p)
    return groups


@torch.no_grad()
def global_grad_norm(
    parameters: Iterable[torch.nn.Parameter], pp_mesh: DeviceMesh | None = None, skip: Iterable[torch.Tensor] = ()
) -> torch.Tensor:
    """The global L2 norm of the gradients as a float64 device tensor (no host sync).

    torch's ``clip_grad_norm_`` needs all gradients of one kind; tensor parallelism leaves some
    plain (modules outside the TP plan) and FSDP puts others on different meshes. Each group's
    norm is computed by torch (a DTensor norm reduces over its mesh), then combined. With
    pipeline parallelism each rank holds only its stages' parameters: the squared norms are
    summed over ``pp_mesh`` so every stage clips by the same global norm; ``skip`` names copies
    of a parameter another pp rank also holds (counted there).
    """
    groups = _grouped(parameters)
    skipped = {id(p) for p in skip}
    device = next((p.device for params in groups.values() for p in params), torch.device("cpu"))
    squares = torch.zeros(1, dtype=torch.float64, device=device)
    for params in groups.values():
        counted = [p.grad for p in params if id(p) not in skipped]
        if not counted:
            continue
        norm = torch.nn.utils.get_total_norm(counted, 2.0)
        norm = (norm.full_tensor() if isinstance(norm, DTensor) else norm).to(device, torch.float64)
        squares += norm * norm
    if pp_mesh is not None:
        dist.all_reduce(squares, group=pp_mesh.get_group())
    return squares[0].sqrt()


@torch.no_grad()
def clip_grads(parameters: Iterable[torch.nn.Parameter], max_norm: float, total: float) -> None:
    """Scale the gradients to global norm ``max_norm`` when their norm ``total`` exceeds it (0 disables)."""
    if max_norm > 0 and math.isfinite(max_norm) and total > max_norm:
        for params in _grouped(parameters).values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, torch.tensor(total))


def clip_grad_norm(
    parameters: Iterable[torch.nn.Parameter],
    max_norm: float,
    pp_mesh: DeviceMesh | None = None,
    skip: Iterable[torch.Tensor] = (),
) -> float:
    """Clip gradients to a global L2 norm ``max_norm`` and return the norm before clipping (see
    :func:`global_grad_norm`; reads the norm on the host). Skipped copies are still clipped."""
    parameters = list(parameters)
    total = global_grad_norm(parameters, pp_mesh, skip).item()
    clip_grads(parameters, max_norm, total)
    return total
