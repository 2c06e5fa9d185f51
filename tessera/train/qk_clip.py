"""QK-clip (Kimi K2's MuonClip): keep attention logits bounded by shrinking query/key projections.

Each training forward reports every attention layer's queries and keys; the largest pre-softmax
logit ``scale * q.k`` per head (over the positions the layer's mask allows, biases excluded) is
kept. After each optimizer step the maxima are combined over all ranks (data-parallel replicas,
tensor-parallel head shards, pipeline stages) and every head whose maximum exceeded the threshold
``tau`` has its query rows scaled by sqrt(gamma) and the rows of its key/value head by the square
root of the smallest gamma among the query heads sharing it (GQA), gamma = tau / max logit: its
logits shrink by at least gamma. Works on plain, FSDP- and TP-sharded weights alike.
"""

from __future__ import annotations

import sys
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from tessera.model.attention import Attention, AttnContext, _allowed
from tessera.parallel.muon import shard_indices

_PIPELINE_SHAPE_PASSES = ("_forward_metadata_inference", "_shape_inference")
_SCORE_BUDGET = 1 << 24  # logits materialized at once while measuring (64 MiB in fp32)


@torch.no_grad()
def max_logits(q: torch.Tensor, k: torch.Tensor, scale: float, ctx: AttnContext) -> torch.Tensor:
    """Per query head, the largest ``scale * q.k`` over the allowed (query, key) pairs: (B, H, Tq, D) -> (H,)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1).float()
    allowed = _allowed(ctx, q.shape[2], k.shape[2], q.device)
    rows = max(1, _SCORE_BUDGET // (q.shape[0] * q.shape[1] * k.shape[2]))
    best = torch.full((q.shape[1],), float("-inf"), device=q.device)
    for start in range(0, q.shape[2], rows):
        scores = (q[:, :, start : start + rows].float() @ k.mT) * scale
        if allowed is not None:
            scores = scores.masked_fill(~allowed[..., start : start + rows, :], float("-inf"))
        best = torch.maximum(best, scores.amax(dim=(0, 2, 3)))
    return best


def _placeholder_forward() -> bool:
    """Whether torch.distributed.pipelining is running a stage on placeholder (uninitialized) inputs to learn
    its shapes, before the first real micro-batch: such logits are meaningless."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name in _PIPELINE_SHAPE_PASSES:
            return True
        frame = frame.f_back
    return False


def _tp_rank(weight: torch.Tensor) -> int:
    """This rank's position among the tensor-parallel shards of ``weight`` (0 without tp)."""
    if isinstance(weight, DTensor) and "tp" in (weight.device_mesh.mesh_dim_names or ()):
        return weight.device_mesh.get_local_rank("tp")
    return 0


def _scale_rows(param: torch.Tensor, factors: torch.Tensor) -> None:
    """``param[r] *= factors[r]`` along dim 0 (global rows), on this rank's shard."""
    local = param.to_local() if isinstance(param, DTensor) else param
    rows = torch.arange(param.shape[0])
    if isinstance(param, DTensor):
        mesh = param.device_mesh
        rows = shard_indices(tuple(param.shape), tuple(mesh.shape), tuple(mesh.get_coordinate()), param.placements)[0]
    scale = factors[rows].to(device=local.device, dtype=local.dtype)
    local.mul_(scale.view(-1, *([1] * (local.ndim - 1))))


class QKClip:
    """Watches the attention layers of ``model`` and clips their logits after every optimizer step."""

    def __init__(self, model: nn.Module, threshold: float) -> None:
        self.threshold = threshold
        self.layers = {
            name.replace("._orig_mod", ""): m for name, m in model.named_modules() if isinstance(m, Attention)
        }
        self.seen: dict[str, torch.Tensor] = {}
        self.last: dict[str, float] = {}
        for name, module in self.layers.items():
            module.qk_observer = partial(self._observe, name, module)

    @classmethod
    def attach(cls, model: nn.Module, optimizer: torch.optim.Optimizer, threshold: float) -> QKClip | None:
        """A QKClip run after each ``optimizer.step()`` (None when ``threshold`` is 0: QK-clip off)."""
        if threshold <= 0:
            return None
        clip = cls(model, threshold)
        optimizer.register_step_post_hook(lambda *_: clip.step())
        return clip

    def _observe(self, name: str, module: Attention, q: torch.Tensor, k: torch.Tensor, ctx: AttnContext) -> None:
        if not module.training or _placeholder_forward():
            return
        peak = max_logits(q, k, module.scale, ctx)
        self.seen[name] = torch.maximum(self.seen[name], peak) if name in self.seen else peak

    def metrics(self) -> dict[str, float]:
        """The last step's max attention logit per layer, as ``max_logit/<layer>`` (all layers, every rank)."""
        return {f"max_logit/{name}": value for name, value in self.last.items()}

    def _global_maxima(self) -> dict[str, torch.Tensor]:
        """Per layer, the max logit of every (global) head over all ranks; collective."""
        mine = {}
        for name, peak in self.seen.items():
            local = peak.tolist()
            mine[name] = (_tp_rank(self.layers[name].q_proj.weight) * len(local), local)
        everyone = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
        merged: dict[str, dict[int, float]] = {}
        for record in everyone:
            for name, (offset, values) in record.items():
                heads = merged.setdefault(name, {})
                for h, value in enumerate(values, offset):
                    heads[h] = max(value, heads.get(h, float("-inf")))
        return {name: torch.tensor([heads[h] for h in sorted(heads)]) for name, heads in merged.items()}

    @torch.no_grad()
    def step(self) -> None:
        """Combine this step's maxima over ranks, log them, and shrink the heads above the threshold."""
        maxima = self._global_maxima()
        self.seen = {}
        self.last = {name: peak.max().item() for name, peak in sorted(maxima.items())}
        for name, peak in maxima.items():
            if name in self.layers and peak.max().item() > self.threshold:
                self._clip(self.layers[name], peak)

    def _clip(self, module: Attention, peak: torch.Tensor) -> None:
        gamma = (self.threshold / peak).clamp(max=1.0)
        kv_gamma = gamma.view(module.n_kv_heads, -1).amin(dim=1)
        for proj, g in ((module.q_proj, gamma), (module.k_proj, kv_gamma)):
            rows = g.sqrt().repeat_interleave(module.head_dim)
            for param in (proj.weight, proj.bias):
                if param is not None:
                    _scale_rows(param, rows)
