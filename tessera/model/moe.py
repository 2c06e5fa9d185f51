"""Mixture of experts: routers (softmax/sigmoid, top-k, group-limited, aux-free bias), capacity, losses, experts.

Experts are stored as batched weights ``gate_proj``/``up_proj`` (E, dim, hidden) and ``down_proj``
(E, hidden, dim), so expert parallelism can shard dimension 0. A forward routes every token,
sorts its (token, choice) assignments by expert and hands the sorted rows with the per-expert
counts to ``experts(rows, counts)``: one grouped matmul per projection where available (bf16),
else a loop over experts. Expert parallelism replaces ``experts`` by a module that sends the rows
to the ranks owning their experts (:mod:`tessera.parallel.expert`); nothing else changes.

No host syncs: routing, capacity and statistics stay tensors (the fp32 loop path alone reads the
counts to split the rows). A layer keeps nothing between forwards: when the caller passes a
:class:`MoELog` (which the model threads down to every MoE layer), each layer records its
:class:`RouterStats` there; see :func:`moe_loss`, :func:`moe_metrics` and :func:`expert_counts`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tessera import registry
from tessera.config import ModelConfig
from tessera.config.checks import require
from tessera.model.ffn import ACTIVATIONS, FFN_TP, GATED, FeedForward, ffn_hidden_size, hidden_bytes
from tessera.model.gpt_oss_experts import gpt_oss_experts


@dataclass
class RouterStats:
    """One MoE layer's routing in one forward; tensors, so reading them is the caller's (one) sync."""

    loss: torch.Tensor  # aux_loss_coef * aux_loss + z_loss_coef * z_loss, differentiable
    aux_loss: torch.Tensor  # load-balancing loss (detached)
    z_loss: torch.Tensor  # router z-loss (detached)
    counts: torch.Tensor  # (E,) routed assignments per expert (float)
    dropped_counts: torch.Tensor  # (E,) of those, dropped by the capacity limit

    @property
    def load(self) -> torch.Tensor:
        """(E,) fraction of routed assignments per expert."""
        return self.counts / self.counts.sum()

    @property
    def dropped(self) -> torch.Tensor:
        """Fraction of assignments dropped by the capacity limit."""
        return self.dropped_counts.sum() / self.counts.sum()


@dataclass(frozen=True)
class TokenGroup:
    """Processes whose tokens are counted together by an MoE layer's balancing statistics.

    Two groups matter (both set by :mod:`tessera.parallel`; the model itself never communicates):
    :attr:`MoE.token_group`, the processes that hold slices of the same sequences (the cp ranks), and
    :attr:`MoE.batch_group`, the processes that hold the global micro-batch (dp x cp ranks), which
    ``aux_loss_scope = "global"`` and ``capacity_scope = "global"`` count over. ``size`` processes,
    this one is ``rank`` of them (data-parallel rank order: the order of the global batch's sequences);
    ``sum`` adds a detached tensor over them (no gradient). The default is this process alone.
    """

    size: int = 1
    sum: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
    rank: int = 0

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """(size, *t.shape): every process's ``t`` in rank order (a sum of zero-padded copies: one all-reduce)."""
        if self.size == 1:
            return t[None]
        rows = t.new_zeros(self.size, *t.shape)
        rows[self.rank] = t
        return self.sum(rows)


class MoELog:
    """What one forward's MoE layers record: their :class:`RouterStats`, in forward order.

    The caller creates one per forward and passes it down (``model(x, moe_log=log)``); a plain
    object rather than a dict, so wrappers that rebuild containers in the inputs (FSDP, DDP) hand
    the layers this very object. A recompute under activation checkpointing overwrites its
    layer's entry with the same numbers.
    """

    def __init__(self) -> None:
        self.layers: dict[nn.Module, RouterStats] = {}

    def record(self, layer: nn.Module, stats: RouterStats) -> None:
        """Keep ``layer``'s stats of this forward."""
        self.layers[layer] = stats

    def __len__(self) -> int:
        return len(self.layers)


def is_moe_layer(cfg: ModelConfig, layer_id: int) -> bool:
    """Whether layer ``layer_id`` uses MoE: past the first ``first_dense`` layers, every ``every``-th."""
    moe = cfg.moe
    return moe.experts > 0 and layer_id >= moe.first_dense and (layer_id + 1) % moe.every == 0


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the expert matmuls run in: autocast's when it is on, else the input's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def uses_grouped_mm(x: torch.Tensor) -> bool:
    """Whether :func:`expert_ffn` runs ``torch._grouped_mm`` (bf16; it rejects fp32 on CPU) or the loop."""
    return hasattr(torch, "_grouped_mm") and _compute_dtype(x) == torch.bfloat16 and x.shape[0] > 0


def _grouped_ffn(x: torch.Tensor, offsets: torch.Tensor, weights: tuple, act) -> torch.Tensor:
    gate, up, down = (w.to(torch.bfloat16) if w is not None else None for w in weights)
    x = x.to(torch.bfloat16)
    h = torch._grouped_mm(x, up, offs=offsets)
    h = act(torch._grouped_mm(x, gate, offs=offsets)) * h if gate is not None else act(h)
    return torch._grouped_mm(h, down, offs=offsets)


def expert_ffn(
    x: torch.Tensor,
    counts: torch.Tensor,
    gate: torch.Tensor | None,
    up: torch.Tensor,
    down: torch.Tensor,
    act,
    sizes: list[int] | None = None,
    padded: bool = True,
) -> torch.Tensor:
    """Experts ``(gate, up, down)[e]`` applied to rows ``x`` (M, dim) grouped by expert.

    The first ``counts[0]`` rows go to expert 0, the next ``counts[1]`` to expert 1, ...; rows
    after ``counts.sum()`` (dropped assignments) come back as zeros. Every expert's weights take
    part in the graph, so an expert without rows gets a zero gradient (not None). ``sizes``:
    ``counts`` as a list when the caller has it (the loop path then needs no host sync).
    ``padded=False`` promises that every row belongs to an expert (no dropped rows).
    """
    ends = counts.cumsum(0)
    if uses_grouped_mm(x):
        if not padded:
            return _grouped_ffn(x, ends.to(torch.int32), (gate, up, down), act).to(_compute_dtype(x))
        # grouped_mm leaves rows past the last group uninitialized, in its output and in its input's
        # gradient: mask both (the output mask also hands its backward the dense gradient it needs).
        valid = (torch.arange(x.shape[0], device=x.device) < ends[-1])[:, None]
        y = _grouped_ffn(torch.where(valid, x, 0.0), ends.to(torch.int32), (gate, up, down), act)
        return torch.where(valid, y, 0.0).to(_compute_dtype(x))
    if sizes is None:
        sizes = counts.tolist()  # the loop needs the group sizes on the host
    parts = x[: sum(sizes)].split(sizes)
    # unbind once: indexing w[e] per expert would make backward add E full-size gradients (O(E^2) memory)
    ups, downs = up.unbind(0), down.unbind(0)
    gates = gate.unbind(0) if gate is not None else [None] * len(sizes)
    outs = []
    for part, g, u, d in zip(parts, gates, ups, downs):
        h = act(part @ g) * (part @ u) if g is not None else act(part @ u)
        outs.append(h @ d)
    y = torch.cat(outs) if outs else x[:0]
    return F.pad(y, (0, 0, 0, x.shape[0] - y.shape[0]))


class Experts(nn.Module):
    """E feed-forward networks as batched weight tensors."""

    def __init__(self, n_experts: int, dim: int, hidden: int, activation: str) -> None:
        super().__init__()
        self.act = ACTIVATIONS[activation]
        self.gated = activation in GATED
        self.gate_proj = nn.Parameter(torch.empty(n_experts, dim, hidden)) if self.gated else None
        self.up_proj = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.down_proj = nn.Parameter(torch.empty(n_experts, hidden, dim))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` applied to tokens ``x`` (N, dim)."""
        h = self.act(x @ self.gate_proj[e]) * (x @ self.up_proj[e]) if self.gated else self.act(x @ self.up_proj[e])
        return h @ self.down_proj[e]

    def forward(self, x: torch.Tensor, counts: torch.Tensor, padded: bool = True) -> torch.Tensor:
        """Rows ``x`` (M, dim) sorted by expert, ``counts`` (E,) rows per expert -> outputs (M, dim);
        ``padded``: rows past ``counts.sum()`` (dropped assignments) may follow, returned as zeros."""
        return expert_ffn(x, counts, self.gate_proj, self.up_proj, self.down_proj, self.act, padded=padded)


@dataclass
class Routing:
    """One forward's routing: what the experts need and what the statistics need."""

    logits: torch.Tensor  # (N, E) float32
    scores: torch.Tensor  # (N, E) softmax probabilities or sigmoid scores
    weights: torch.Tensor  # (N, k) combine weights of the chosen experts
    ids: torch.Tensor  # (N, k) chosen experts, best first
    keep: torch.Tensor  # (N, k) within capacity


class MoE(nn.Module):
    """Routed experts (plus optional always-on shared experts) replacing a block's FFN.

    ``token_group`` and ``batch_group``: see :class:`TokenGroup`. The per-process losses are scaled so
    that their mean over the group is the loss of the group's tokens (as the LM loss's token share),
    which the data-parallel gradient average then turns into the single-process gradient.
    """

    token_group: TokenGroup = TokenGroup()
    batch_group: TokenGroup = TokenGroup()

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        self.cfg = moe
        self.n_experts, self.top_k = moe.experts, moe.top_k
        self.capacity_factor = moe.capacity_factor
        hidden = moe.ffn_hidden or ffn_hidden_size(
            cfg.dim, cfg.activation, cfg.ffn_hidden, cfg.ffn_multiplier, cfg.multiple_of
        )
        self.router = nn.Linear(cfg.dim, moe.experts, bias=moe.router_bias)
        self.experts = gpt_oss_experts(cfg, hidden) or Experts(moe.experts, cfg.dim, hidden, cfg.activation)
        shared_hidden = moe.shared_ffn_hidden or hidden * moe.shared_experts
        self.shared = FeedForward(cfg.dim, shared_hidden, cfg.activation) if moe.shared_experts else None
        self.shared_gate = nn.Linear(cfg.dim, 1, bias=False) if moe.shared_gate else None
        if moe.expert_bias or moe.bias_update_rate > 0:
            self.register_buffer("expert_bias", torch.zeros(moe.experts))
        else:
            self.expert_bias = None

    def reset_parameters(self) -> None:
        """Zero the aux-free balancing bias (the weights are initialized by the model's init)."""
        if self.expert_bias is not None:
            self.expert_bias.zero_()

    def _choice_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """Scores the top-k choice ranks by: plus the balancing bias, limited to the best expert groups."""
        choice = scores if self.expert_bias is None else scores + self.expert_bias
        groups = self.cfg.groups
        if groups == 1:
            return choice
        grouped = choice.view(choice.shape[0], groups, -1)
        # DeepSeek-V3: a group's score is the sum of its two best experts' scores.
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        best = group_scores.topk(self.cfg.topk_groups, dim=-1).indices
        allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, best, True)
        return grouped.masked_fill(~allowed[..., None], float("-inf")).view_as(choice)

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Top-k weights (N, k), expert ids (N, k) and the scores (N, E: softmax or sigmoid) of router logits."""
        router = self.cfg.router
        scores = logits.sigmoid() if router == "sigmoid" else logits.softmax(dim=-1)
        ids = self._choice_scores(scores).topk(self.top_k, dim=-1).indices
        if router == "topk_softmax":  # the softmax renormalized over the chosen experts
            weights = logits.gather(1, ids).softmax(dim=-1)
        else:
            weights = scores.gather(1, ids)
            if router == "sigmoid" and self.cfg.norm_topk:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.cfg.route_scale, ids, scores

    def _keep(self, ids: torch.Tensor) -> torch.Tensor:
        """(N, k) bool: assignments within expert capacity; first choices go first, then token order.

        With ``capacity_scope = "global"`` capacity and order are those of the whole global micro-batch
        (sequences in data-parallel rank order), so every layout drops the assignments one process would."""
        if self.capacity_factor <= 0:
            return torch.ones_like(ids, dtype=torch.bool)
        n, k, e = ids.shape[0], self.top_k, self.n_experts
        group = self.batch_group if self.cfg.capacity_scope == "global" else TokenGroup()
        capacity = math.ceil(self.capacity_factor * n * group.size * k / e)
        onehot = F.one_hot(ids.T.reshape(-1), e)  # choice-major priority
        slot = (onehot.cumsum(0) * onehot).sum(-1) - 1
        if group.size > 1:
            offsets = self._earlier_slots(onehot.view(k, n, e).sum(1), group)  # (k, E)
            slot = slot + (onehot * offsets.repeat_interleave(n, 0)).sum(-1)
        return (slot < capacity).view(k, n).T

    @staticmethod
    def _earlier_slots(local: torch.Tensor, group: TokenGroup) -> torch.Tensor:
        """(k, E) slots other processes fill before this one's first assignment of each (choice, expert):
        earlier choices on every process, the same choice on lower ranks."""
        every = group.gather(local.float())  # (size, k, E)
        earlier_choices = (every.sum(0) - local).cumsum(0) - (every.sum(0) - local)
        lower_ranks = every[: group.rank].sum(0)
        return (earlier_choices + lower_ranks).long()

    def _routed(self, x: torch.Tensor, r: Routing) -> torch.Tensor:
        """The weighted sum of each token's kept experts: sort assignments by expert, run, scatter back."""
        flat = torch.where(r.keep, r.ids, self.n_experts).flatten()  # dropped ones sort last
        order = flat.argsort(stable=True)
        counts = torch.zeros(self.n_experts + 1, dtype=torch.long, device=x.device)
        counts = counts.scatter_add(0, flat, torch.ones_like(flat))[: self.n_experts]
        token = order // self.top_k
        rows, w = x[token], (r.weights * r.keep).flatten()[order]
        if self.cfg.scale_input:  # Llama 4: the expert sees its input times the routing weight (see moe_routing.py)
            rows, w = rows * w[:, None].to(rows.dtype), r.keep.flatten()[order].to(w.dtype)
        y = self.experts(rows, counts, padded=self.capacity_factor > 0)
        return torch.zeros_like(x).index_add(0, token, (y * w[:, None].to(y.dtype)).to(x.dtype))

    def forward(self, x: torch.Tensor, log: MoELog | None = None) -> torch.Tensor:
        """Route each token of ``x`` (B, T, dim) to its experts and mix their outputs; record into ``log``."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.router(x).float()
        weights, ids, scores = self.route(logits)
        routing = Routing(logits, scores, weights, ids, self._keep(ids))
        out = self._routed(x, routing)
        if self.shared is not None:
            shared = self.shared(x)
            out = out + (shared * torch.sigmoid(self.shared_gate(x)) if self.shared_gate is not None else shared)
        if log is not None:
            log.record(self, self.stats(routing, shape[0] if len(shape) == 3 else 1))
        return out.view(shape)

    def _balance_loss(self, r: Routing, batch: int) -> torch.Tensor:
        """Switch/Mixtral batch loss ``E * sum_e f_e * P_e`` (f: assignments per token, P: mean score),
        or DeepSeek's per-sequence loss ``mean_b sum_e f_be * P_be`` with f normalized to 1 when uniform.

        f counts the assignments of the whole :attr:`batch_group` (scope "global": the global micro-batch)
        or :attr:`token_group` ("micro": this process's sequences, "sequence"), detached: counts carry no
        gradient. P is this process's mean, so the group's mean of these losses is the loss of the group's
        tokens (every process of the group holds as many tokens)."""
        probs = r.scores if self.cfg.router != "sigmoid" else r.scores / r.scores.sum(-1, keepdim=True)
        ones = torch.ones_like(r.weights)
        n, e, scope = r.ids.shape[0], self.n_experts, self.cfg.aux_loss_scope
        group = self.batch_group if scope == "global" else self.token_group
        if scope != "sequence":
            counts = group.sum(ones.new_zeros(e).scatter_add(0, r.ids.flatten(), ones.flatten()))
            return e * (counts / (n * group.size) * probs.mean(0)).sum()
        seq_len = n // batch
        seq = torch.arange(n, device=r.ids.device) // seq_len
        index = (r.ids + seq[:, None] * e).flatten()
        counts = group.sum(ones.new_zeros(batch * e).scatter_add(0, index, ones.flatten()).view(batch, e))
        f = counts * e / (self.top_k * seq_len * group.size)
        return (f * probs.view(batch, seq_len, e).mean(1)).sum(-1).mean()

    def stats(self, r: Routing, batch: int = 1) -> RouterStats:
        """Load-balancing loss, z-loss and per-expert counts of one forward (``batch`` sequences)."""
        aux = self._balance_loss(r, batch)
        z = torch.logsumexp(r.logits, dim=-1).pow(2).mean()  # a token group's processes hold equal token counts
        loss = self.cfg.aux_loss_coef * aux + self.cfg.z_loss_coef * z
        ids = r.ids.flatten()
        counts = r.logits.new_zeros(self.n_experts).scatter_add(0, ids, torch.ones_like(ids, dtype=r.logits.dtype))
        dropped = r.logits.new_zeros(self.n_experts).scatter_add(0, ids, (~r.keep).flatten().to(r.logits.dtype))
        return RouterStats(loss, aux.detach(), z.detach(), counts.detach(), dropped.detach())


def moe_loss(log: MoELog) -> torch.Tensor | None:
    """The summed weighted auxiliary losses of one forward's MoE layers (None without MoE)."""
    if not log.layers:
        return None
    return sum(stats.loss for stats in log.layers.values())


def moe_metrics(logs: list[MoELog]) -> dict[str, torch.Tensor]:
    """Aux loss, z loss, dropped fraction and imbalance (max / mean expert load), averaged over the
    layers and forwards of ``logs``; tensors, so the caller reads them once per logged step."""
    stats = [s for log in logs for s in log.layers.values()]
    if not stats:
        return {}
    n = len(stats)
    return {
        "moe_aux_loss": sum(s.aux_loss for s in stats) / n,
        "moe_z_loss": sum(s.z_loss for s in stats) / n,
        "moe_dropped": sum(s.dropped for s in stats) / n,
        "moe_load_max": sum(s.load.max() * s.load.numel() for s in stats) / n,
    }


def expert_load(log: MoELog) -> list[torch.Tensor]:
    """Per-layer fraction of routed assignments that went to each expert (E,), in forward order."""
    return [s.load for s in log.layers.values()]


def moe_layer_names(model: nn.Module) -> dict[nn.Module, str]:
    """Each MoE layer of ``model`` -> its name in the unwrapped model (activation checkpointing and
    compile wrappers left out), the key that :func:`expert_counts` orders layers by."""
    names = {}
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            names[module] = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
    return names


def expert_counts(
    logs: list[MoELog], names: dict[nn.Module, str], order: list[str], n_experts: int, device: torch.device
) -> torch.Tensor:
    """(layers, 2, E) routed and dropped assignments per expert, summed over ``logs``; layers follow
    ``order`` (every MoE layer of the full model), zero for layers this process does not hold."""
    out = torch.zeros(len(order), 2, n_experts, device=device)
    index = {name: i for i, name in enumerate(order)}
    for log in logs:
        for layer, s in log.layers.items():
            out[index[names[layer]], 0] += s.counts
            out[index[names[layer]], 1] += s.dropped_counts
    return out


@torch.no_grad()
def update_expert_bias(names: dict[nn.Module, str], order: list[str], counts: torch.Tensor, rate: float) -> None:
    """Aux-loss-free balancing (DeepSeek-V3): nudge each expert's bias by ``rate`` towards the mean load.

    ``counts`` is :func:`expert_counts` summed over every process of the step (so all processes
    move their copies of a bias alike); an underloaded expert's bias rises, an overloaded one's falls.
    """
    index = {name: i for i, name in enumerate(order)}
    for layer, name in names.items():
        if layer.expert_bias is None:
            continue
        load = counts[index[name], 0].to(layer.expert_bias.device)
        layer.expert_bias.add_(rate * torch.sign(load.mean() - load))


def expert_load_report(order: list[str], counts: torch.Tensor, width: int = 40) -> str:
    """Per-layer expert load of (layers, 2, E) :func:`expert_counts`: a bar per expert, dropped
    fraction and imbalance (max / mean load), like ``tessera data inspect``."""
    lines = []
    for name, (routed, dropped) in zip(order, counts.tolist()):
        total = sum(routed) or 1.0
        load = [c / total for c in routed]
        imbalance = max(load) * len(load)
        lines.append(
            f"{name}: {int(sum(routed)):,} assignments, dropped {sum(dropped) / total:.2%}, imbalance {imbalance:.2f}"
        )
        peak = max(load) or 1.0
        for e, share in enumerate(load):
            lines.append(f"  expert {e:>3}  {share:6.2%}  {'#' * round(width * share / peak)}")
    return "\n".join(lines)


def check_moe(m: ModelConfig) -> None:
    """[model.moe] of a model with experts: top-k, capacity, losses and the expert groups."""
    moe = m.moe
    require(
        1 <= moe.top_k <= moe.experts, f"model.moe.top_k={moe.top_k} must be in [1, model.moe.experts={moe.experts}]"
    )
    require(
        moe.capacity_factor >= 0, f"model.moe.capacity_factor must be >= 0 (0 = dropless), got {moe.capacity_factor}"
    )
    require(
        moe.aux_loss_coef >= 0 and moe.z_loss_coef >= 0,
        "model.moe.aux_loss_coef and model.moe.z_loss_coef must be >= 0",
    )
    require(
        moe.experts % moe.groups == 0,
        f"model.moe.groups={moe.groups} must divide model.moe.experts={moe.experts} (equal expert groups)",
    )
    per_group = moe.experts // moe.groups
    require(
        moe.topk_groups <= moe.groups and moe.top_k <= moe.topk_groups * per_group,
        f"model.moe.topk_groups={moe.topk_groups} groups of {per_group} experts cannot hold top_k={moe.top_k}; "
        f"use topk_groups in [1, groups={moe.groups}] with topk_groups * experts / groups >= top_k",
    )
    require(
        not moe.shared_gate or moe.shared_experts > 0,
        "model.moe.shared_gate gates the shared experts; set model.moe.shared_experts > 0",
    )


def _routed_bytes(shape: Any, prec: Any) -> float:
    """Per-token bytes of a routed MoE layer (router, dispatch, experts, weighting), all whole under TP."""
    h, c, k, e = shape.dim, prec.compute, shape.top_k, shape.experts
    inputs = c * h  # the routed rows, cast once for all expert projections (one grouped matmul each)
    per_assignment = 12 + inputs + hidden_bytes(shape.expert_hidden, shape.gated, c) + c * h + prec.stream * h
    router = c * h + 8.0 * e + 12 * k + 4
    shared = shape.cfg.moe.shared_experts
    shared_bytes = hidden_bytes(shape.expert_hidden * shared, shape.gated, c) if shared else 0.0
    return router + k * per_assignment + shared_bytes


def moe_memory(shape: Any, block: Any, prec: Any) -> tuple[float, float, float, float]:
    """The planner's term (plan/activations.py): (gathered, sharded, op gathered, op sharded) saved bytes per
    token of a MoE sublayer (experts stay whole under TP: nothing is sharded)."""
    h, c = shape.dim, prec.compute
    op = shape.top_k * (((3 if shape.gated else 2) * shape.expert_hidden + h) * c) + 4.0 * shape.experts
    return _routed_bytes(shape, prec), 0.0, c * h + op, 0.0


MOE = registry.register(
    registry.Spec(
        kind="ffn",
        name="moe",
        feature="mixture of experts",
        keys=("model.moe",),
        uses=lambda m: m.moe.experts > 0,
        unsupported={},
        checks=(check_moe,),
        terms=registry.Terms(flops=registry.zero, memory=moe_memory),  # active experts' matmuls are in 6 * N_active
        tp_plan=FFN_TP,  # the shared experts' projections; the routed experts stay whole (expert parallelism)
    )
)

CAPACITY = registry.option(
    name="moe_capacity",
    feature="MoE capacity limit (token dropping)",
    keys=("model.moe.capacity_factor",),
    uses=lambda m: m.moe.experts > 1 and m.moe.capacity_factor > 0,
    unsupported={
        "cp": "which tokens an expert drops depends on their order across the ranks' slices; use "
        "model.moe.capacity_factor=0 (dropless)",
    },
    checks=(),
)
