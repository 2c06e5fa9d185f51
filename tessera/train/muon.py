"""Muon for hidden matrices and AdamW for everything else, in one optimizer with optional bf16 state.

Muon (Jordan et al. 2024; Moonlight, Liu et al. 2025) replaces each matrix's update by its
orthogonalized Nesterov momentum. Parameter groups flagged ``muon`` get that update; the others
get AdamW's. One optimizer keeps one state dict, so DCP checkpoints and reshards Muon's momentum
buffers like Adam's moments. The orthogonalization of sharded matrices (FSDP2, TP, HSDP) and of
expert stacks is :func:`tessera.parallel.muon.orthogonalize`.

State can be kept in bf16 (``state_dtype``): each step reads it, computes in the gradient's
precision and stores it back rounded to nearest.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam  # torch's functional AdamW (decoupled_weight_decay=True)

from tessera.parallel.muon import orthogonalize

RMS_SCALE = 0.2  # Moonlight: 0.2 * sqrt(max(fan_out, fan_in)) gives the update AdamW's typical RMS


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (an alias: in-place changes reach the DTensor), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _grad(p: torch.Tensor) -> torch.Tensor:
    """The local gradient of ``p``, laid out like ``p`` (a TP embedding's gradient can arrive replicated)."""
    grad = p.grad
    if isinstance(grad, DTensor) and grad.placements != p.placements:
        grad = grad.redistribute(p.device_mesh, p.placements)
    return _local(grad)


def fans(shape: torch.Size) -> tuple[int, int]:
    """(fan_out, fan_in) of a Muon matrix: an nn.Linear weight (out, in), or an expert stack (E, in, out)."""
    return (shape[-2], shape[-1]) if len(shape) == 2 else (shape[-1], shape[-2])


def update_scale(shape: torch.Size, rule: str) -> float:
    """The factor on the learning rate of an orthogonalized update of a matrix of ``shape``.

    ``rms``: 0.2 sqrt(max(fan_out, fan_in)), Moonlight's rule (torch.optim.Muon's ``match_rms_adamw``);
    ``spectral``: sqrt(max(1, fan_out / fan_in)), Keller Jordan's original (torch's ``original``).
    """
    fan_out, fan_in = fans(shape)
    if rule == "rms":
        return RMS_SCALE * math.sqrt(max(fan_out, fan_in))
    return math.sqrt(max(1.0, fan_out / fan_in))


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the parameter groups with ``muon=True`` (2-D matrices or (E, in, out) stacks), AdamW on the rest.

    Group keys: ``lr``, ``weight_decay`` (decoupled, ``lr * weight_decay`` for both kinds, as torch),
    AdamW's ``betas`` and ``eps``, Muon's ``momentum``, ``nesterov``, ``ns_steps`` and ``scale``
    ("rms" or "spectral", see :func:`update_scale`). ``ns_dtype`` is the precision of the
    Newton-Schulz iteration, ``state_dtype`` that of the momentum buffers and Adam moments. With no
    Muon group this is AdamW (torch.optim.AdamW's update, optionally with bf16 state). ``adamw_kernel``
    (``{"fused": True}`` or ``{"foreach": True}``, fp32 state) runs the AdamW groups through torch's kernel.
    """

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        scale: str = "rms",
        ns_dtype: torch.dtype = torch.bfloat16,
        state_dtype: torch.dtype = torch.float32,
        adamw_kernel: dict[str, bool] | None = None,
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "muon": False,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_steps": ns_steps,
            "scale": scale,
        }
        super().__init__(params, defaults)
        self.ns_dtype, self.state_dtype = ns_dtype, state_dtype
        # torch's fused or foreach AdamW kernel for the AdamW groups (fp32 state only); None: the loop below
        torch_kernel = adamw_kernel and any(adamw_kernel.values()) and state_dtype == torch.float32
        self.adamw_kernel = adamw_kernel if torch_kernel else None
        for group in self.param_groups:
            bad = [tuple(p.shape) for p in group["params"] if group["muon"] and p.ndim not in (2, 3)]
            if bad:
                raise ValueError(f"Muon takes matrices or (E, in, out) expert stacks, got shapes {bad}")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        muon = [g for g in self.param_groups if g["muon"]]
        if muon:
            self._muon_step(muon)
        for group in self.param_groups:
            if not group["muon"]:
                self._adamw_step(group)
        return loss

    def _state(self, p: torch.Tensor, *names: str) -> list[torch.Tensor]:
        state = self.state[p]
        if not state:
            if "exp_avg" in names:
                # torch.optim.AdamW's step counter, for its bias correction (on the device for the fused kernel)
                state["step"] = torch.tensor(0.0, device=_local(p).device if self.adamw_kernel else "cpu")
            for name in names:
                state[name] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format)
        return [state[name] for name in names]

    def _muon_step(self, groups: list[dict[str, Any]]) -> None:
        """Momentum per matrix, one (collective) orthogonalization of all of them, then the updates."""
        todo, updates = [], []
        for group in groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                (buf,) = self._state(p, "momentum_buffer")
                grad, m = _grad(p), group["momentum"]
                momentum = _lerp_stored(_local(buf), grad, 1 - m)
                update = grad.lerp(momentum, m) if group["nesterov"] else momentum
                if isinstance(p, DTensor):
                    update = DTensor.from_local(
                        update, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False
                    )
                todo.append((group, p))
                updates.append(update)
        for (group, p), ortho in zip(todo, orthogonalize(updates, groups[0]["ns_steps"], self.ns_dtype)):
            local = _local(p)
            local.mul_(1 - group["lr"] * group["weight_decay"])
            local.add_(ortho, alpha=-group["lr"] * update_scale(p.shape, group["scale"]))

    def _adamw_step(self, group: dict[str, Any]) -> None:
        """torch.optim.AdamW's update (decoupled decay, bias-corrected moments), moments stored in ``state_dtype``."""
        if self.adamw_kernel is not None:
            self._torch_adamw_step(group)
            return
        beta1, beta2 = group["betas"]
        lr, eps = group["lr"], group["eps"]
        for p in group["params"]:
            if p.grad is None:
                continue
            exp_avg, exp_avg_sq = self._state(p, "exp_avg", "exp_avg_sq")
            self.state[p]["step"] += 1
            step = self.state[p]["step"].item()
            grad, local = _grad(p), _local(p)
            local.mul_(1 - lr * group["weight_decay"])
            m = _lerp_stored(_local(exp_avg), grad, 1 - beta1)
            v = _local(exp_avg_sq)
            v32 = v if v.dtype == grad.dtype else v.to(grad.dtype)
            v32.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            if v32 is not v:
                v.copy_(v32)
            denom = (v32.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
            local.addcdiv_(m, denom, value=-lr / (1 - beta1**step))

    def _torch_adamw_step(self, group: dict[str, Any]) -> None:
        """The same update by torch's functional AdamW with ``adamw_kernel`` (fused: one kernel, no host reads)
        on the local shards."""
        params = [p for p in group["params"] if p.grad is not None]
        moments = [self._state(p, "exp_avg", "exp_avg_sq") for p in params]
        beta1, beta2 = group["betas"]
        adam(
            [_local(p) for p in params],
            [_grad(p) for p in params],
            [_local(m) for m, _ in moments],
            [_local(v) for _, v in moments],
            [],
            [self.state[p]["step"] for p in params],
            decoupled_weight_decay=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
            **self.adamw_kernel,
        )


def _lerp_stored(stored: torch.Tensor, value: torch.Tensor, weight: float) -> torch.Tensor:
    """``stored += weight * (value - stored)`` kept in ``stored``'s dtype; returns the result in ``value``'s."""
    if stored.dtype == value.dtype:
        return stored.lerp_(value, weight)
    result = stored.to(value.dtype).lerp_(value, weight)
    stored.copy_(result)
    return result
