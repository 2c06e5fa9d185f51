"""Context parallelism: every rank of the ``cp`` mesh holds a slice of each sequence.

The sequence of ``T`` tokens is cut into ``2 * cp`` chunks and rank ``r`` holds chunks ``r`` and
``2 * cp - 1 - r`` ("zigzag"), so under a causal mask every rank has the same amount of attention
work. Everything outside attention is per token and runs on the local slice unchanged; the model
learns about the split through its :class:`~tessera.model.attention.SequenceSplit` hook, which this
module fills in:

- positions (RoPE, learned tables) are the tokens' *global* indices, unless the batch brings its
  own (document-restarting positions, already global values);
- attention of the local queries over all keys, with the mask built from global token indices and,
  with document masks, the document ids of every rank (all-gathered once per forward, for all
  layers). Two schemes compute it:

  ``allgather`` (default): keys and values are all-gathered (differentiable: the backward is a
  reduce-scatter) and the model's own kernel runs with the global mask; any mask works.
  ``ring``: key/value blocks travel around the ring (point-to-point, the next transfer overlapping
  the current block's work) and are merged by an online log-sum-exp softmax; backward is a second
  ring pass in which each block's key/value gradients travel with it. Only two blocks are resident
  at a time, for lengths where the gathered keys/values would not fit.

The loss of a rank is the sum over its tokens divided by the global token count of the batch, times
``cp`` because FSDP averages gradients over the ``dp_shard x cp`` mesh (a local mean would weight
ranks with fewer unmasked tokens wrongly). MoE layers likewise: the load-balancing loss uses the
expert counts of the whole sequences (summed over the cp ranks, detached) with the local router
scores, so the mean over the cp ranks of each rank's loss is the loss of the whole sequences.
torch's experimental ``context_parallel`` has no CPU implementation (no CPU SDPA backend has a
sharding rule; FlexAttention has no CPU backward), hence this hand-written version.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tessera.model.attention import Attention, AttnContext, kernel_spec
from tessera.model.masks import MaskSpec, allowed
from tessera.model.moe import MoE, TokenGroup
from tessera.model.sinks import ring_sink_grad, ring_start
from tessera.model.transformer import Stack

METHODS = ("allgather", "ring")
# Scores a ring step materializes at once (queries are processed in chunks below this many elements).
_RING_CHUNK_ELEMENTS = 1 << 20

AttendFn = Callable[[Attention, torch.Tensor, torch.Tensor, torch.Tensor, AttnContext], torch.Tensor]


def zigzag_index(seq_len: int, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """Global indices (seq_len / cp,) of the tokens rank ``rank`` holds: chunks ``rank`` and
    ``2 * cp - 1 - rank`` of ``2 * cp`` equal chunks."""
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, second])


class ContextParallel:
    """The :class:`~tessera.model.attention.SequenceSplit` of one cp mesh: zigzag positions and the
    cross-rank attention of ``method`` ("allgather" or "ring")."""

    def __init__(self, mesh: DeviceMesh, method: str = "allgather") -> None:
        if method not in METHODS:
            raise ValueError(f"parallel.cp_method must be one of {', '.join(METHODS)}, got {method!r}")
        self.mesh, self.method = mesh, method
        self.group = mesh.get_group()
        self.size, self.rank = mesh.size(), mesh.get_local_rank()

    def index(self, length: int, device: torch.device) -> torch.Tensor:
        """Global indices of this rank's ``length`` tokens."""
        return zigzag_index(length * self.size, self.size, self.rank, device)

    def positions(self, length: int, device: torch.device) -> torch.Tensor:
        """(1, length) global positions of this rank's tokens."""
        return self.index(length, device)[None]

    def key_positions(self, length: int, device: torch.device) -> torch.Tensor:
        """(1, length * cp) global positions of the all-gathered keys, in rank order (all-gather only: the
        ring never holds them at once)."""
        if self.method == "ring":
            raise ValueError("parallel.cp_method='ring' takes no score bias (ALiBi, T5); use allgather")
        return torch.cat([zigzag_index(length * self.size, self.size, r, device) for r in range(self.size)])[None]

    def attention(
        self, spec: MaskSpec, length: int, document_ids: torch.Tensor | None, device: torch.device
    ) -> AttendFn:
        """The attention core shared by one forward's layers (documents all-gathered here, once). A kernel without
        scores (linear, performer) runs its own split form on the local keys (the layer's context holds the split)."""
        if not kernel_spec(spec.kernel).scores:
            return lambda attn, q, k, v, layer: attn.attend(q, k, v, dataclasses.replace(layer, attend=None))
        q_idx = self.index(length, device)
        kv_idx = [zigzag_index(length * self.size, self.size, r, device) for r in range(self.size)]
        kv_doc = self._gather_documents(document_ids)
        if self.method == "ring":

            def step_mask(src: int, rows: slice) -> torch.Tensor:
                docs = () if document_ids is None else (document_ids[:, rows, None], kv_doc[src][:, None, :])
                mask = allowed(spec, q_idx[rows, None], kv_idx[src][None, :], *docs)
                return mask.view(-1, 1, *mask.shape[-2:])

            def ring(attn: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, _: AttnContext):
                sinks = attn.sinks() if getattr(attn, "sinks", None) is not None else None
                return RingAttention.apply(q, k, v, step_mask, attn.scale, self.group, sinks)

            return ring
        keys = torch.cat(kv_idx)
        docs = () if document_ids is None else (document_ids[:, :, None], torch.cat(kv_doc, 1)[:, None, :])
        mask = allowed(spec, q_idx[:, None], keys[None, :], *docs).view(-1, 1, length, keys.numel())
        # sdpa would turn a bool mask into a float copy per layer: share one (a score bias needs the bool one)
        additive = mask
        if not kernel_spec(spec.kernel).dense_mask:
            additive = torch.zeros(mask.shape, device=device).masked_fill_(~mask, float("-inf"))
        plain, biased = AttnContext(mask=additive), AttnContext(mask=mask)

        def attend(attn: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttnContext):
            ctx = plain if layer.bias is None else dataclasses.replace(biased, bias=layer.bias)
            return attn.attend(q, gather_sequence(k, self.group), gather_sequence(v, self.group), ctx)

        return attend

    def whole_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T_local, ...) -> (B, T, ...) in sequence order: all-gathered along dim 1 (differentiable: the
        backward reduce-scatters, so each rank's slice gets the gradient every rank's queries sent it), then the
        zigzag undone. An encoder-decoder's decoder cross-attends to all of its encoder's positions this way."""
        every = funcol.wait_tensor(funcol.all_gather_single_autograd(x.contiguous(), 1, self.group))
        length = x.shape[1] * self.size
        order = torch.cat([zigzag_index(length, self.size, r, x.device) for r in range(self.size)]).argsort()
        return every.index_select(1, order)

    # Recurrent mixers (tessera.model.recurrent.RecurrentSplit): this rank holds sequence chunks ``rank`` and
    # ``2 cp - 1 - rank``; a scan visits the 2 cp chunks in order, so the pieces' halos and entering states come
    # from the ranks holding the chunks before them (all-gathered, differentiable: gradients reach those ranks).

    def _chunk_owner(self, chunk: int) -> tuple[int, int]:
        """(rank, local piece) holding global chunk ``chunk`` of the 2 cp."""
        return (chunk, 0) if chunk < self.size else (2 * self.size - 1 - chunk, 1)

    def pieces(self, length: int) -> list[slice]:
        """The two zigzag chunks of this rank's ``length`` tokens."""
        half = length // 2
        return [slice(0, half), slice(half, length)]

    def _in_order(self, local: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's (pieces, ...) tensor, all-gathered, as one entry per global chunk in sequence order."""
        every = funcol.wait_tensor(funcol.all_gather_tensor_autograd(local.contiguous(), 0, self.group))
        every = every.view(self.size, *local.shape)
        return [every[rank][piece] for rank, piece in map(self._chunk_owner, range(2 * self.size))]

    def halos(self, tails: torch.Tensor) -> torch.Tensor:
        """The last inputs of the chunk before each local piece (zeros before the first chunk)."""
        ordered = self._in_order(tails.movedim(2, 0))
        mine = (self.rank, 2 * self.size - 1 - self.rank)
        return torch.stack([ordered[c - 1] if c else torch.zeros_like(ordered[0]) for c in mine], dim=2)

    def entering_states(
        self, transitions: torch.Tensor, contributions: torch.Tensor, elementwise: bool = False
    ) -> torch.Tensor:
        """The state entering each local piece: the chunks' summaries combined in order from a zero state
        (S <- A @ S + H, or A * S + H with ``elementwise``; one all-gather of both, flattened)."""
        a_shape, h_shape = transitions.shape[1:], contributions.shape[1:]
        flat = torch.cat([contributions.flatten(1), transitions.to(contributions.dtype).flatten(1)], dim=1)
        ordered = [s.split([h_shape.numel(), a_shape.numel()]) for s in self._in_order(flat)]
        state, entering = contributions.new_zeros(h_shape), []
        for h, a in ordered:
            entering.append(state)
            a, h = a.view(a_shape), h.view(h_shape)
            state = (a * state if elementwise else a @ state) + h
        return torch.stack([entering[self.rank], entering[2 * self.size - 1 - self.rank]])

    def maximum(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise maximum of ``x`` over the cp ranks (detached)."""
        return funcol.wait_tensor(funcol.all_reduce(x.detach().contiguous(), "max", self.group))

    def _gather_documents(self, document_ids: torch.Tensor | None) -> list[torch.Tensor] | None:
        if document_ids is None:
            return None
        parts = [torch.empty_like(document_ids) for _ in range(self.size)]
        dist.all_gather(parts, document_ids.contiguous(), group=self.group)
        return parts


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather (B, H, T_local, D) along the sequence in rank order; backward reduce-scatters."""
    return funcol.wait_tensor(funcol.all_gather_single_autograd(x.contiguous(), 2, group))


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh, method: str = "allgather") -> None:
    """Make every stack of ``model`` attend as a slice of a sequence split over ``cp_mesh``, and every MoE
    layer balance its experts over the whole sequences (expert counts summed over the cp ranks)."""
    split = ContextParallel(cp_mesh, method)
    tokens = cp_token_group(cp_mesh)
    for module in model.modules():
        if isinstance(module, Stack):
            module.sequence_split = split
        if isinstance(module, MoE):  # parallelize widens batch_group to the dp x cp ranks when dp > 1
            module.token_group = module.batch_group = tokens


def cp_token_group(cp_mesh: DeviceMesh) -> TokenGroup:
    """The MoE :class:`TokenGroup` of a cp mesh: its ranks' tokens make up every sequence."""
    return mesh_token_group(cp_mesh)


def mesh_token_group(mesh: DeviceMesh) -> TokenGroup:
    """The MoE :class:`TokenGroup` of the ranks of a (flattened) 1-D ``mesh``: detached sums over it."""
    group = mesh.get_group()

    def sum_over_mesh(t: torch.Tensor) -> torch.Tensor:
        return funcol.wait_tensor(funcol.all_reduce(t.detach(), "sum", group))

    return TokenGroup(mesh.size(), sum_over_mesh, mesh.get_local_rank())


# ----------------------------------------------------------------------------------------------
# Ring attention


def _rotate(tensors: list[torch.Tensor], group: dist.ProcessGroup, tag: int = 0) -> Callable[[], list[torch.Tensor]]:
    """Start sending ``tensors`` to the next rank and receiving the previous rank's; returns a wait
    function giving the received tensors (``tag`` keeps concurrent rotations apart)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    nxt, prv = dist.get_global_rank(group, (rank + 1) % size), dist.get_global_rank(group, (rank - 1) % size)
    tensors = [t.contiguous() for t in tensors]
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, nxt, group, tag) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, prv, group, tag) for t in received]
    works = dist.batch_isend_irecv(ops)

    def wait() -> list[torch.Tensor]:
        for work in works:
            work.wait()
        return received

    return wait


def _chunks(q_len: int, per_query: int) -> list[slice]:
    """Query ranges whose scores stay under ``_RING_CHUNK_ELEMENTS``."""
    size = max(1, _RING_CHUNK_ELEMENTS // max(per_query, 1))
    return [slice(i, min(i + size, q_len)) for i in range(0, q_len, size)]


def _scores(q5: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """(B, Hkv, rep, Tq, Tk) masked fp32 scores of grouped queries (B, Hkv, rep, Tq, D) over keys."""
    s = (q5 @ k.float()[:, :, None].transpose(-2, -1)) * scale
    return s.masked_fill(~mask[:, :, None], float("-inf"))


class RingAttention(torch.autograd.Function):
    """softmax(QK^T)V of local queries over every rank's keys, key/value blocks passed around the ring.

    ``step_mask(src, rows)`` is the (B|1, 1, rows, Tk) bool mask of a range of the local queries
    over rank ``src``'s keys: built per chunk of queries, so no (Tq, Tk) tensor exists at once.
    Keys/values keep their own (GQA) head count while travelling. Attention sinks (H,) start each
    query's log-sum-exp, on the queries' own rank: they enter each softmax once, whatever ``cp``.
    """

    @staticmethod
    def forward(ctx: Any, q, k, v, step_mask: Callable[[int, slice], torch.Tensor], scale: float, group, sinks=None):
        """One ring pass: each step merges one rank's key/value block while the next one travels."""
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        b, hkv = k.shape[:2]
        q5 = q.float().view(b, hkv, -1, *q.shape[2:])
        out = q5.new_zeros(*q5.shape[:-1], v.shape[-1])  # values may be narrower than keys (latent attention)
        lse = torch.full(q5.shape[:-1], float("-inf"), device=q.device)
        if sinks is not None:
            lse = ring_start(sinks, lse.shape)
        kk, vv = k, v
        for step in range(size):
            wait = _rotate([kk, vv], group) if step < size - 1 else None
            for rows in _chunks(q.shape[2], b * q.shape[1] * k.shape[2]):
                mask = step_mask((rank - step) % size, rows)
                if not mask.any():  # e.g. causal: a block entirely in these queries' future
                    continue
                s = _scores(q5[..., rows, :], kk, mask, scale)
                block_lse = torch.logsumexp(s, dim=-1)
                p = torch.exp(s - block_lse[..., None]).nan_to_num(0.0)
                new = torch.logaddexp(lse[..., rows], block_lse)
                keep, add = (torch.exp(x - new).nan_to_num(0.0)[..., None] for x in (lse[..., rows], block_lse))
                out[..., rows, :] = out[..., rows, :] * keep + (p @ vv.float()[:, :, None]) * add
                lse[..., rows] = new
            if wait is not None:
                kk, vv = wait()
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.step_mask, ctx.scale, ctx.group = step_mask, scale, group
        return out.view(*q.shape[:-1], v.shape[-1]).to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor):
        """A second ring pass recomputing each block's probabilities from the saved log-sum-exp."""
        q, k, v, out, lse, sinks = ctx.saved_tensors
        rank, size = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        q5 = q.float().view(*out.shape[:-1], q.shape[-1])
        dout5 = dout.float().view_as(out)
        delta = (dout5 * out).sum(-1)
        dq = torch.zeros_like(q5)
        kk, vv = k, v
        dk, dv = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
        for step in range(size):
            wait = _rotate([kk, vv], ctx.group) if step < size - 1 else None
            _ring_backward_block(
                q5, kk, vv, dout5, lse, delta, ctx.step_mask, (rank - step) % size, ctx.scale, dq, dk, dv
            )
            # The key/value gradients travel with their block; after the last hop they are home.
            dk, dv = _rotate([dk, dv], ctx.group, tag=1)()
            if wait is not None:
                kk, vv = wait()
        dsinks = ring_sink_grad(sinks, lse, delta) if sinks is not None else None
        return dq.view_as(q).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, dsinks


def _ring_backward_block(q5, k, v, dout5, lse, delta, step_mask, src, scale, dq, dk, dv) -> None:
    """Accumulate the contribution of rank ``src``'s key/value block to dq, dk, dv in place."""
    kf, vf = k.float()[:, :, None], v.float()[:, :, None]
    for rows in _chunks(q5.shape[-2], q5[..., 0, 0].numel() * k.shape[2]):
        mask = step_mask(src, rows)
        if not mask.any():
            continue
        s = _scores(q5[..., rows, :], k, mask, scale)
        p = torch.exp(s - lse[..., rows, None]).nan_to_num(0.0)
        g = dout5[..., rows, :]
        dv += (p.transpose(-2, -1) @ g).sum(2)
        ds = p * (g @ vf.transpose(-2, -1) - delta[..., rows, None])
        dq[..., rows, :] += (ds @ kf) * scale
        dk += (ds.transpose(-2, -1) @ q5[..., rows, :]).sum(2) * scale


# ----------------------------------------------------------------------------------------------
# The batch and the loss


def shard_batch(
    args: tuple[torch.Tensor, ...],
    kwargs: dict[str, Any],
    labels: torch.Tensor,
    loss_mask: torch.Tensor | None,
    cp_mesh: DeviceMesh,
) -> tuple[tuple[torch.Tensor, ...], dict[str, Any], torch.Tensor, torch.Tensor | None]:
    """This rank's zigzag slice (along the sequence, dim 1) of a batch's inputs, labels and masks; each tensor is
    cut along its own length (an encoder-decoder's encoder inputs are longer than its decoder inputs)."""
    size, rank = cp_mesh.size(), cp_mesh.get_local_rank()

    def cut(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            return x
        if x.shape[1] % (2 * size):  # the config checks rule this out (train.seq_len, span-corruption lengths)
            raise ValueError(f"a sequence of {x.shape[1]} tokens does not cut into 2 x cp={2 * size} equal chunks")
        return x[:, zigzag_index(x.shape[1], size, rank, x.device)]

    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}, cut(labels), cut(loss_mask)


def loss_scale(labels: torch.Tensor, loss_mask: torch.Tensor | None, cp_mesh: DeviceMesh) -> float:
    """What turns this rank's mean token loss into its share for FSDP's average over dp_shard x cp:
    ``cp * local tokens / global tokens`` (one all-reduce of the token count)."""
    local = float(labels.numel() if loss_mask is None else loss_mask.sum())
    if loss_mask is None:
        return 1.0  # every rank holds the same number of tokens
    total = torch.tensor([local], dtype=torch.float64, device=labels.device)
    dist.all_reduce(total, group=cp_mesh.get_group())
    return cp_mesh.size() * local / max(total.item(), 1.0)
