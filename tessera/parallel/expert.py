"""Expert parallelism: each MoE layer's experts sharded over the ``ep`` mesh, tokens sent to them.

An MoE layer sorts its (token, choice) assignments by expert and calls ``experts(rows, counts)``
(:mod:`tessera.model.moe`). Expert parallelism replaces that module by
:class:`ExpertParallelExperts`, whose weights are DTensors sharded along the expert dimension
(rank ``r`` of ``ep`` holds experts ``r*E/ep ... (r+1)*E/ep - 1``), so checkpoints store the
full tensors and reshard across ep sizes. Its forward:

1. exchanges the per-expert row counts with an all-to-all (the one host sync: uneven all-to-all
   sizes must be known on the host, as in torchtitan and Megatron);
2. sends each row to the rank owning its expert (all-to-all with uneven, possibly zero, splits);
3. reorders the received rows from source-rank-major to expert-major and runs the local experts
   (one grouped matmul in bf16, else a loop);
4. sends the outputs back the same way; the MoE layer weights and sums them.

The ep mesh is carved from the data-parallel ranks (dp_shard x cp) and, with tensor
parallelism, the tp ranks (no expert tensor parallelism), see :class:`ParallelDims`. The tp
ranks of a group hold the same tokens (the MoE input is replicated over tp), so each sends
only its share of the sorted rows and the outputs are all-gathered over tp afterwards; routing,
capacity and statistics stay replicated, exactly as without expert parallelism.

Gradients: all-to-all's backward sends each row's gradient back to the expert's rank, so an
expert's gradient sums over the tokens of every data-parallel rank of its ep group. FSDP then
shards the experts over the remaining "efsdp" ranks and must divide their summed gradient by the
whole data-parallel degree (not by the efsdp size, its default): see :func:`shard_experts`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

from tessera.model.gpt_oss_experts import BANKS, BiasedExperts, biased_expert_ffn
from tessera.model.moe import Experts, MoE, expert_ffn
from tessera.parallel.context import mesh_token_group

_WEIGHTS = ("gate_proj", "up_proj", "down_proj")


class ExpertParallelExperts(Experts):
    """This rank's ``E / ep`` experts (DTensors sharded along the expert dim) and the all-to-all around them."""

    def __init__(self, experts: Experts, ep_mesh: DeviceMesh, tp_mesh: DeviceMesh | None = None) -> None:
        nn.Module.__init__(self)
        self.act, self.gated = getattr(experts, "act", None), experts.gated
        # gpt-oss's biased experts: their biases are sharded like the weights and run the biased loop
        self.limit = experts.limit if isinstance(experts, BiasedExperts) else None
        names = BANKS if self.limit is not None else _WEIGHTS
        self.ep_mesh, self.tp_mesh = ep_mesh, tp_mesh
        n_experts, ep = experts.up_proj.shape[0], ep_mesh.size()
        if n_experts % ep:
            raise ValueError(f"{n_experts} experts cannot be split over ep={ep} ranks")
        self.n_experts, self.n_local = n_experts, n_experts // ep
        first = ep_mesh.get_local_rank() * self.n_local
        for name in names:
            full = getattr(experts, name)
            if full is None:
                self.register_parameter(name, None)
                continue
            local = full.detach()[first : first + self.n_local].clone()
            self.register_parameter(name, nn.Parameter(DTensor.from_local(local, ep_mesh, (Shard(0),))))

    def _local_weights(self) -> list[torch.Tensor | None]:
        return [p.to_local() if isinstance(p, DTensor) else p for p in (self.gate_proj, self.up_proj, self.down_proj)]

    def forward(self, x: torch.Tensor, counts: torch.Tensor, padded: bool = True) -> torch.Tensor:
        """Rows ``x`` (M, dim) sorted by (global) expert with ``counts`` (E,) per expert -> outputs (M, dim).

        Dropped rows (past ``counts.sum()``) are not sent, so ``padded`` needs no special case."""
        rows, own = self._share_over_tp(x, counts)
        out = self._dispatch_and_combine(rows, own)
        return self._gather_over_tp(out, x.shape)

    def _share_over_tp(self, x: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This tp rank's contiguous share of the (tp-replicated) rows and its per-expert counts."""
        if self.tp_mesh is None:
            return x, counts
        tp = self.tp_mesh
        # Backward of Replicate -> Shard(0) all-gathers the rows' gradients over tp.
        rows = DTensor.from_local(x, tp, (Replicate(),)).redistribute(tp, (Shard(0),)).to_local()
        lo = min(tp.get_local_rank() * math.ceil(x.shape[0] / tp.size()), x.shape[0])
        hi = lo + rows.shape[0]
        ends = counts.cumsum(0)
        return rows, ends.clamp(lo, hi) - (ends - counts).clamp(lo, hi)

    def _gather_over_tp(self, out: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        if self.tp_mesh is None:
            return out
        tp = self.tp_mesh
        full = DTensor.from_local(out, tp, (Shard(0),), shape=shape, stride=(shape[1], 1))
        # Every tp rank continues with the same outputs, so backward keeps only the local share (no comm).
        return full.redistribute(tp, (Replicate(),)).to_local()

    def _dispatch_and_combine(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        group, ep, n_local = self.ep_mesh.get_group(), self.ep_mesh.size(), self.n_local
        received_counts = funcol.wait_tensor(funcol.all_to_all_single(counts, None, None, group))
        sizes = torch.cat([counts, received_counts]).tolist()  # the host sync: all-to-all needs its sizes
        sent, received = sizes[: self.n_experts], sizes[self.n_experts :]
        in_splits = [sum(sent[r * n_local : (r + 1) * n_local]) for r in range(ep)]
        out_splits = [sum(received[r * n_local : (r + 1) * n_local]) for r in range(ep)]
        routed = funcol.all_to_all_single_autograd(rows[: sum(in_splits)].contiguous(), out_splits, in_splits, group)
        routed = funcol.wait_tensor(routed)
        # Received rows are source-rank-major; the local experts want them expert-major.
        local_ids = torch.arange(n_local, device=rows.device).repeat(ep)
        expert_of_row = local_ids.repeat_interleave(received_counts, output_size=sum(out_splits))
        perm = expert_of_row.argsort(stable=True)
        per_expert = [sum(received[r * n_local + e] for r in range(ep)) for e in range(n_local)]
        local_counts = received_counts.view(ep, n_local).sum(0)
        if self.limit is not None:
            banks = [getattr(self, name).to_local() for name in BANKS]
            y = biased_expert_ffn(routed[perm], per_expert, banks, self.limit)
        else:
            y = expert_ffn(routed[perm], local_counts, *self._local_weights(), self.act, per_expert, padded=False)
        y = y[perm.argsort()]
        back = funcol.wait_tensor(funcol.all_to_all_single_autograd(y, in_splits, out_splits, group))
        return F.pad(back, (0, 0, 0, rows.shape[0] - back.shape[0]))


def apply_global_batch_group(model: nn.Module, batch_mesh: DeviceMesh) -> None:
    """Make every MoE layer count its global-scope balancing statistics and capacity over ``batch_mesh``
    (the dp x cp ranks that together hold the global micro-batch): one small all-reduce per layer, no
    host sync, and every data-parallel layout routes and balances as one process would."""
    tokens = mesh_token_group(batch_mesh)
    for module in model.modules():
        if isinstance(module, MoE):
            module.batch_group = tokens


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, tp_mesh: DeviceMesh | None = None) -> None:
    """Shard every MoE layer's experts over ``ep_mesh`` in place (``tp_mesh``: the tp ranks in it, if any)."""
    for module in list(model.modules()):
        if isinstance(module, MoE) and not isinstance(module.experts, ExpertParallelExperts):
            module.experts = ExpertParallelExperts(module.experts, ep_mesh, tp_mesh)


def shard_experts(
    block: nn.Module,
    mesh: DeviceMesh,
    mp: MixedPrecisionPolicy,
    offload: OffloadPolicy,
    reshard_after_forward: bool,
    data_parallel_degree: int,
) -> None:
    """``fully_shard`` a block's expert-parallel experts over the efsdp ``mesh`` (before the block itself).

    FSDP would divide the experts' gradient by the efsdp size, but it sums the tokens of all
    ``data_parallel_degree`` ranks: divide by that. gloo has no PREMUL_SUM, so reduce with SUM
    and divide afterwards (the same numbers on NCCL). Over a single shard rank no reduce-scatter
    runs and torch 2.13 would then divide twice with forced SUM (copy and post-divide), so it is
    only forced there when the shard dimension has several ranks.
    """
    for module in block.modules():
        if isinstance(module, ExpertParallelExperts):
            fully_shard(
                module, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, offload_policy=offload
            )
            module.set_gradient_divide_factor(float(data_parallel_degree))
            module.set_force_sum_reduction_for_comms(mesh.size(mesh.ndim - 1) > 1)
