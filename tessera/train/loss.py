"""Training losses: next-token cross-entropy, and the output head fused with it in chunks.

:func:`lm_loss` is the plain loss on materialized logits.

:class:`FusedHeadLoss` is what the trainer hands the model as ``output_fn``: instead of
``output(h)`` (logits of shape tokens x vocab, then an fp32 copy of them for the loss, then fp32
gradients of the same size) the model calls ``FusedHeadLoss(h, output)``, which walks over the
tokens in chunks and computes each chunk's logits, its share of the loss and, when gradients are
needed, its gradients with respect to the hidden states and the head's weight at once
(Liger-Kernel's "gradient in forward"). Only one chunk of logits exists at a time and backward
only scales the stored gradients, so the head still costs three matmuls. The loss and gradients
equal :func:`lm_loss` on ``output(h)`` within float32 rounding; under autocast the head's matmuls
run in the autocast dtype and the softmax in float32, as before.

Under tensor parallelism the head's weight is vocab-sharded (a DTensor): each rank computes the
logits of its vocabulary rows, and per chunk one all-reduce of the row maxima and one of (sum of
exponentials, target logit, sum of logits) over the tp group give every token's loss, as
``loss_parallel`` does on the sharded logits. The hidden-state gradient leaves as a partial sum
that DTensor's autograd reduces (all-reduce, or reduce-scatter under sequence parallelism).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

IGNORE_INDEX = -100  # F.cross_entropy's default: labels equal to it get no loss
# Logits per chunk (tokens x vocab) of the fused head: 64 MiB in float32, e.g. 512 tokens at vocab 32k.
CHUNK_LOGITS = 1 << 24


def lm_loss(
    logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0, loss_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean next-token cross-entropy in float32, over the positions where ``loss_mask`` (B, T) is true."""
    if loss_mask is None:
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), label_smoothing=label_smoothing)
    losses = F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), label_smoothing=label_smoothing, reduction="none"
    )
    mask = loss_mask.flatten().float()
    if isinstance(losses, DTensor):  # loss parallelism: the per-token losses are replicated over tp
        mask = DTensor.from_local(mask, losses.device_mesh, losses.placements, run_check=False)
    return (losses * mask).sum() / mask.sum().clamp(min=1.0)


def token_weights(labels: torch.Tensor, loss_mask: torch.Tensor | None) -> torch.Tensor:
    """Each token's weight in the mean loss (N,): 1/count on counted tokens, 0 on masked or ignored ones.

    The same mean as :func:`lm_loss` (F.cross_entropy skips labels equal to ``IGNORE_INDEX``).
    """
    counted = labels.flatten() != IGNORE_INDEX
    if loss_mask is not None:
        counted = counted & loss_mask.flatten().bool()
    counted = counted.float()
    return counted / counted.sum().clamp(min=1.0)


def chunk_tokens(vocab: int, tokens: int, chunk: int = 0) -> int:
    """Tokens per chunk: ``chunk`` when > 0, else as many as keep a chunk's logits at ``CHUNK_LOGITS``."""
    size = chunk if chunk > 0 else max(64, CHUNK_LOGITS // max(vocab, 1))
    return max(1, min(size, tokens))


def _compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmuls run in: autocast's when it is on, else the weight's."""
    device = weight.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


def _no_autocast(device: torch.device) -> contextlib.AbstractContextManager:
    return (
        torch.autocast(device.type, enabled=False)
        if torch.is_autocast_enabled(device.type)
        else (contextlib.nullcontext())
    )


class _Shard:
    """Where this rank's rows of the head sit in the vocabulary: (tp group or None, first row, vocab size)."""

    def __init__(self, group: dist.ProcessGroup | None, first: int, vocab: int) -> None:
        self.group, self.first, self.vocab = group, first, vocab

    def all_reduce(self, t: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        """Reduce over the tp group (nothing on a whole head)."""
        if self.group is not None:
            dist.all_reduce(t, op=op, group=self.group)
        return t


def _chunk_loss_(z: torch.Tensor, y: torch.Tensor, shard: _Shard, smoothing: float):
    """Per-token loss of float32 logits ``z`` (C, rows): (loss, sum of exps, local target column, target here).

    Leaves exp(z - row max) in ``z`` (in place): the softmax's numerators, which the gradient reuses, so a
    chunk's logits are exponentiated once and no temporary of the chunk's size is made.
    """
    top = shard.all_reduce(z.max(dim=-1).values, dist.ReduceOp.MAX)
    local = y - shard.first
    hit = (local >= 0) & (local < z.shape[1])  # the target is one of this rank's rows (always on a whole head)
    target = local.clamp(0, z.shape[1] - 1)
    parts = [z.gather(1, target[:, None]).squeeze(1) * hit] + ([z.sum(-1)] if smoothing else [])
    sums = shard.all_reduce(torch.stack([z.sub_(top[:, None]).exp_().sum(-1), *parts]))
    lse = top + sums[0].log()
    ce = lse - sums[1]
    if smoothing:
        ce = (1.0 - smoothing) * ce + smoothing * (lse - sums[2] / shard.vocab)
    return ce, sums[0], target, hit


def _logits_grad_(
    e: torch.Tensor,
    total: torch.Tensor,
    target: torch.Tensor,
    hit: torch.Tensor,
    weights: torch.Tensor,
    smoothing: float,
    vocab: int,
) -> torch.Tensor:
    """In place on ``e`` = exp(logits - row max), ``total`` its (all-rank) row sums: d loss / d logits =
    w * (softmax - (1 - eps) * onehot - eps / V)."""
    e.div_(total[:, None])
    e.scatter_add_(1, target[:, None], -(1.0 - smoothing) * hit.to(e.dtype)[:, None])
    if smoothing:
        e.sub_(smoothing / vocab)
    return e.mul_(weights[:, None])


def _softcap_(z: torch.Tensor, cap: float) -> torch.Tensor:
    """In place: ``z`` -> cap * tanh(z / cap) (a soft-capped head, Gemma 2); returns d capped / d z = 1 - tanh^2."""
    t = z.div_(cap).tanh_()
    slope = 1.0 - t * t
    t.mul_(cap)
    return slope


class _LinearCrossEntropy(torch.autograd.Function):
    """sum_i w_i * CE(h_i @ W.T + b, y_i) over a whole or vocab-sharded head, chunk by chunk (see the module doc)."""

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        bias,
        labels,
        weights,
        smoothing: float,
        chunk: int,
        dtype,
        shard: _Shard,
        twice: bool,
        cap: float = 0.0,
    ):
        needs_grad = any(ctx.needs_input_grad[:3])
        ctx.twice, ctx.results = twice, None
        w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if needs_grad else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs_grad else None
        grad_b = torch.zeros(w.shape[0], dtype=torch.float32, device=w.device) if needs_grad and b is not None else None
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start : start + chunk].to(dtype)
            wt = weights[start : start + chunk]
            z = (h @ w.t() if b is None else torch.addmm(b, h, w.t())).float()
            slope = _softcap_(z, cap) if cap else None
            ce, total, target, hit = _chunk_loss_(z, labels[start : start + chunk], shard, smoothing)
            loss += (wt * ce).sum()
            if needs_grad:
                g = _logits_grad_(z, total, target, hit, wt, smoothing, shard.vocab)
                g = (g if slope is None else g.mul_(slope)).to(dtype)
                grad_h[start : start + chunk] = g @ w
                grad_w += (g.t() @ h).float()
                if grad_b is not None:
                    grad_b += g.float().sum(0)
                del g
            del z, slope  # before the next chunk's logits exist: one chunk's buffers at a time, not two
        ctx.grads = (grad_h, grad_w, grad_b)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.results is not None:  # the second pass of a split backward: the same gradient of the loss
            return ctx.results
        (grad_h, grad_w, grad_b), (w_dtype, b_dtype) = ctx.grads, ctx.dtypes
        ctx.grads = None
        grad_h = grad_h.mul_(grad_loss)
        grad_w = grad_w.mul_(grad_loss).to(w_dtype)
        grad_b = None if grad_b is None else grad_b.mul_(grad_loss).to(b_dtype)
        results = (grad_h, grad_w, grad_b, None, None, None, None, None, None, None, None)
        if ctx.twice:
            ctx.results = results
        return results


def _vocab_shard(weight: DTensor) -> tuple[DeviceMesh, int]:
    """The 1-D mesh a head weight is vocab-sharded (Shard(0)) over, and the first row this rank holds."""
    dims = [i for i, p in enumerate(weight.placements) if p == Shard(0)]
    if len(dims) != 1 or any(p != Replicate() for i, p in enumerate(weight.placements) if i != dims[0]):
        raise ValueError(f"the fused vocab-parallel loss needs a head weight sharded on dim 0, got {weight.placements}")
    mesh = weight.device_mesh
    if mesh.ndim > 1:
        mesh = mesh[mesh.mesh_dim_names[dims[0]]]
    rows = -(-weight.shape[0] // mesh.size())  # DTensor shards like torch.chunk: ceil(V / n) rows each
    return mesh, mesh.get_local_rank() * rows


def _local_operands(hidden, weight, bias) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, _Shard]:
    """Plain tensors for the kernel: (hidden (N, D), weight rows, bias rows, shard)."""
    if not isinstance(weight, DTensor):
        return hidden.reshape(-1, hidden.shape[-1]), weight, bias, _Shard(None, 0, weight.shape[0])
    mesh, first = _vocab_shard(weight)
    if isinstance(hidden, DTensor):  # sequence parallel: gather the sequence (its gradient is reduce-scattered)
        hidden = hidden.redistribute(mesh, (Replicate(),))
    else:  # replicated over tp: the partial gradients are all-reduced
        hidden = DTensor.from_local(hidden, mesh, (Replicate(),), run_check=False)
    local = hidden.to_local(grad_placements=(Partial(),))
    bias = None if bias is None else bias.to_local()
    return local.reshape(-1, local.shape[-1]), weight.to_local(), bias, _Shard(mesh.get_group(), first, weight.shape[0])


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    label_smoothing: float = 0.0,
    chunk: int = 0,
    backward_twice: bool = False,
    softcap: float = 0.0,
) -> torch.Tensor:
    """:func:`lm_loss` of ``hidden @ weight.T + bias`` (soft-capped at ``softcap`` when > 0) without materializing
    the logits (a plain scalar tensor).

    ``hidden`` (B, T, D); ``weight`` (V, D) and ``bias`` (V), plain or vocab-sharded DTensors (then
    ``hidden`` is a DTensor or a tensor replicated over the tp ranks); ``labels`` and ``loss_mask``
    (B, T), whole on every rank; ``chunk`` tokens per chunk (0: :func:`chunk_tokens`'s default).
    ``backward_twice``: the gradients are kept for a second backward pass through the loss (the
    zero-bubble pipeline schedules run one for the input gradients, then one for the weights'),
    otherwise freed by the first.
    """
    dtype = _compute_dtype(weight)
    flat, w, b, shard = _local_operands(hidden, weight, bias)
    if flat.shape[0] != labels.numel():
        raise ValueError(f"hidden states of {flat.shape[0]} tokens for {labels.numel()} labels")
    size = chunk_tokens(shard.vocab, flat.shape[0], chunk)
    weights = token_weights(labels, loss_mask)
    with _no_autocast(flat.device):
        return _LinearCrossEntropy.apply(
            flat, w, b, labels.flatten(), weights, float(label_smoothing), size, dtype, shard, backward_twice, softcap
        )


class FusedHeadLoss:
    """The trainer's ``output_fn``: the model calls it with its final hidden states and its head.

    A plain object (not a dataclass or a tensor container) so that FSDP's and DDP's input handling
    pass it to the model untouched.
    """

    def __init__(
        self,
        labels: torch.Tensor,
        loss_mask: torch.Tensor | None,
        label_smoothing: float = 0.0,
        chunk: int = 0,
        backward_twice: bool = False,
    ) -> None:
        self.labels, self.loss_mask = labels, loss_mask
        self.label_smoothing, self.chunk, self.backward_twice = label_smoothing, chunk, backward_twice

    def __call__(self, hidden: torch.Tensor, output: nn.Linear) -> torch.Tensor:
        """The mean loss of ``output(hidden)`` against the labels."""
        smoothing, chunk, twice = self.label_smoothing, self.chunk, self.backward_twice
        return linear_cross_entropy(
            hidden,
            output.weight,
            output.bias,
            self.labels,
            self.loss_mask,
            smoothing,
            chunk,
            twice,
            getattr(output, "cap", 0.0),  # a soft-capped head (tessera.model.softcap.SoftcappedHead)
        )
