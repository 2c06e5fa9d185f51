"""The torchft step runner (``parallel.fault_tolerance = "torchft"``): a step survives a dead replica group.

Each step: torchft's quorum of the live replica groups (a group that is behind, e.g. restarted,
first receives the live model, optimizer, LR schedule and data position from a peer), then the
micro-batches of this group's shares of the global batch (``parallel/ft.py``), one
``Manager.allreduce`` of the flattened gradients and the loss (averaged over the groups in the
quorum), and ``Manager.should_commit``: every group commits or none does. A step whose collective
or commit failed because a peer died is **redone** by the survivors with the data position
rewound to the step's start and the dead group's shares taken over, so no committed step ever
mixes a partial gradient and the global batch is kept: the survivors lose no step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from tessera.config import ConfigError
from tessera.model import MoELog
from tessera.parallel.ft import ReplicaState, build_manager, my_slots, slot_rows
from tessera.parallel.grads import clip_grads, global_grad_norm
from tessera.parallel.loss import MicroBatch
from tessera.train.steps import StepParts, TorchSteps, runner_class

MAX_ATTEMPTS = 20  # redone attempts of one step before the run gives up (each waits a quorum)


class FaultTolerantSteps(TorchSteps):
    """The torch runner's losses and update, with the gradient average and the commit handed to torchft."""

    def __init__(self, parts: StepParts) -> None:
        super().__init__(parts)
        self.ft = parts.config.parallel.ft
        self.loader: Any = None
        self.manager: Any = None
        self.redone = 0  # steps attempted again after a failed collective or commit (whole run)
        self.healed: list[dict[str, float]] = []  # each live recovery: the step received and its seconds

    @classmethod
    def check_config(cls, config: Any) -> None:
        """fp16 scaling is per replica group (its overflow skips would diverge): refuse it."""
        if config.train.dtype == "fp16":
            raise ConfigError("train.dtype='fp16' is not supported with parallel.fault_tolerance='torchft'; use bf16")

    def bind_loader(self, loader: Any) -> None:
        """The training loader, whose position is rewound on a redone step and sent to a joining group."""
        self.loader = loader

    def _state(self) -> dict[str, Any]:
        p = self.parts
        return {
            "model": p.model.state_dict(),
            "optim": p.optimizer.state_dict(),
            "scheduler": p.scheduler.state_dict(),
            "loader": self.loader.state_dict(),
        }

    def _load(self, state: dict[str, Any]) -> None:
        p = self.parts
        p.model.load_state_dict(state["model"])
        p.optimizer.load_state_dict(state["optim"])
        p.scheduler.load_state_dict(state["scheduler"])
        self.loader.load_state_dict(state["loader"])

    def _manager(self, step: int) -> Any:
        if self.manager is None:
            self.manager, self._store = build_manager(self.parts.config.parallel, ReplicaState(self._state, self._load))
            # a run resumed from its checkpoint starts at its step (joining groups then heal from the newest)
            self.manager.load_state_dict({"step": step - 1, "batches_committed": 0})
        return self.manager

    def step(self, step: int, next_batch: Callable[[], MicroBatch]) -> dict[str, Any]:
        """One committed optimizer step, redone until the quorum commits it; ``trained_step`` is its number."""
        manager = self._manager(step)
        for _ in range(MAX_ATTEMPTS):
            metrics = self._attempt(manager, next_batch)
            if metrics is not None:
                return metrics
            self.redone += 1
        raise RuntimeError(f"torchft: step {manager.current_step() + 1} failed {MAX_ATTEMPTS} times in a row")

    def _attempt(self, manager: Any, next_batch: Callable[[], MicroBatch]) -> dict[str, Any] | None:
        """One try at the next step: its metrics when committed, None when it must be redone."""
        p = self.parts
        before = manager.current_step()
        started = time.perf_counter()
        manager.start_quorum()  # may heal: weights, optimizer, schedule and loader from a peer
        if manager.current_step() != before:
            self.healed.append({"step": manager.current_step(), "seconds": time.perf_counter() - started})
        position = self.loader.state_dict()
        p.optimizer.zero_grad(set_to_none=False)
        participants = manager.num_participants()
        slots = my_slots(self.ft.replicas, participants, manager.participating_rank())
        loss = self._accumulate_slots(next_batch, slots, participants / self.ft.replicas)
        loss = self._average(manager, loss)
        grad_norm = global_grad_norm(p.model.parameters(), None, [])
        loss_value, norm_value = float(loss), float(grad_norm)
        lr = p.scheduler.get_last_lr()[0]
        if not manager.should_commit():
            self.loader.load_state_dict(position)  # the survivors redo the step over the same samples
            p.optimizer.zero_grad(set_to_none=False)
            return None
        step = manager.current_step()
        if p.nonfinite.allows_update(step, loss_value, norm_value, lr) and p.spikes.judge(step, loss_value, norm_value):
            clip_grads(p.model.parameters(), p.config.optim.grad_clip, norm_value)
            p.optimizer.step()
            p.scheduler.step()
        p.optimizer.zero_grad(set_to_none=False)
        return {
            "loss": loss_value,
            "lr": lr,
            "grad_norm": norm_value,
            "ft_replicas": float(participants),
            "ft_redone": float(self.redone),
            "trained_step": step,
        }

    def _accumulate_slots(self, next_batch: Callable[[], MicroBatch], slots: list[int], weight: float) -> torch.Tensor:
        """Forward and backward of this group's shares of each micro-batch; its weighted loss (detached)."""
        p = self.parts
        accum, smoothing = p.config.train.grad_accum, p.config.train.label_smoothing
        total = torch.zeros((), dtype=torch.float64, device=p.parallel.device)
        for _ in range(accum):
            batch = next_batch()  # the whole global micro-batch: every group reads the same stream
            for slot in slots:
                part = slot_rows(batch, slot, self.ft.replicas)
                with p.loss.context():
                    loss = p.loss(part, smoothing, MoELog(), token_scale=1.0) * (weight / accum)
                    loss.backward()
                total += loss.detach().double()
        return total

    def _average(self, manager: Any, loss: torch.Tensor) -> torch.Tensor:
        """Gradients and loss averaged over the quorum's groups in one ``Manager.allreduce`` (what torchft's DDP
        comm hook does per bucket); a dead peer makes it error, which ``should_commit`` then reports."""
        params = [q for q in self.parts.model.parameters() if q.requires_grad]
        grads = [q.grad if q.grad is not None else torch.zeros_like(q) for q in params]
        flat = torch.cat([_flatten_dense_tensors(grads).float(), loss.reshape(1).float()])
        manager.allreduce(flat).wait()
        for param, grad in zip(params, _unflatten_dense_tensors(flat[:-1], grads)):
            param.grad = grad.to(param.dtype).view_as(param)
        return flat[-1]

    def summary(self) -> dict[str, Any]:
        """For summary.json: steps redone after a failed peer, and each live recovery of this group."""
        return {"fault_tolerance": {"redone_steps": self.redone, "healed": self.healed}}


def runner_for(config: Any) -> type[TorchSteps]:
    """The runner a job trains with: torchft's under ``parallel.fault_tolerance='torchft'``, else the engine's."""
    return FaultTolerantSteps if config.parallel.fault_tolerance == "torchft" else runner_class(config)
