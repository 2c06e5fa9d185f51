"""Multi-token prediction (DeepSeek-V3, section 2.2): ``model.mtp_depth`` sequential modules that each predict
one token further ahead.

Module ``k`` (1-based) at position ``i`` combines the previous depth's hidden state ``h[k-1]_i`` (the
main model's final, normed hidden state for ``k = 1``) with the embedding of token ``i + k``:
``eh_proj([enorm(emb(t[i+k])); hnorm(h[k-1]_i)])``, runs one transformer block (causal, like the
main stack's) and predicts token ``i + k + 1`` through its own final norm and the model's shared
output head. The embedding is the model's too. Names follow DeepSeek-V3's checkpoints (``enorm``,
``hnorm``, ``eh_proj``, ``shared_head.norm`` = our ``norm``), whose concatenation order (embedding
first) this keeps.

Training runs every depth on the whole sequence: the inputs ``t[i+k]`` are the tokens rolled left
by ``k`` and the targets the labels rolled left by ``k``, with the last ``k`` positions (whose inputs
wrapped around) left out of the loss (:func:`mtp_targets`). A forward records the per-depth logits
in an :class:`MTPLog` the caller passes (a plain object, like :class:`~tessera.model.moe.MoELog`).
At decoding time the same modules draft tokens for self-speculative decoding
(:mod:`tessera.model.speculative`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from tessera import registry
from tessera.config import ModelConfig
from tessera.model.attention import AttnContext
from tessera.model.block import LayerCache, TransformerBlock
from tessera.model.norm import build_norm

if TYPE_CHECKING:
    from tessera.model.moe import MoELog


class MTPLog:
    """What one forward's MTP modules produce: ``logits[k - 1]`` (B, T, vocab) of depth ``k``.

    On a pipeline's last stage, which has no token embedding, ``embeddings`` carries the embedded
    input tokens (B, T, dim) that the first stage sent along.
    """

    def __init__(self, embeddings: torch.Tensor | None = None, ahead: torch.Tensor | None = None) -> None:
        self.embeddings = embeddings
        # (B, T, D) tokens ``k`` ahead of each position at ``[..., k - 1]``, made before the sequence was split
        # (context parallelism: the tokens ahead of a rank's last positions are on another rank).
        self.ahead = ahead
        self.logits: list[torch.Tensor] = []


class MTPModule(nn.Module):
    """One prediction depth: two norms, the projection of their concatenation, a block, a final norm."""

    def __init__(self, cfg: ModelConfig, depth: int) -> None:
        super().__init__()
        self.enorm = build_norm(cfg.norm, cfg.dim, cfg.norm_eps)
        self.hnorm = build_norm(cfg.norm, cfg.dim, cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.block = TransformerBlock(cfg, cfg.n_layers + depth - 1)
        self.norm = build_norm(cfg.norm, cfg.dim, cfg.norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        embedded: torch.Tensor,
        ctx: AttnContext,
        cache: LayerCache | None = None,
        start: int = 0,
    ) -> torch.Tensor:
        """This depth's hidden states (B, T, dim), before ``norm``, from the previous depth's and the
        embeddings of the tokens one step further."""
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        return self.block(x, ctx, cache, start)


def build_mtp(cfg: ModelConfig) -> nn.ModuleDict | None:
    """``model.mtp_depth`` modules keyed "0", "1", ... (None without multi-token prediction)."""
    if not cfg.mtp_depth:
        return None
    return nn.ModuleDict({str(k): MTPModule(cfg, k + 1) for k in range(cfg.mtp_depth)})


def _embeddings_ahead(model: nn.Module, tokens: torch.Tensor, log: MTPLog, depth: int) -> torch.Tensor:
    """Embeddings of the tokens ``depth`` positions ahead (rolled: the last ``depth`` wrap around)."""
    if log.ahead is not None and model.tok_embeddings is not None:
        return model.tok_embeddings(log.ahead[..., depth - 1])
    if model.tok_embeddings is not None:
        return model.tok_embeddings(tokens.roll(-depth, dims=1))
    if log.embeddings is None:
        raise ValueError("multi-token prediction without the token embedding needs MTPLog(embeddings=...)")
    return log.embeddings.roll(-depth, dims=1)


def predict_ahead(
    model: nn.Module,  # the Decoder (model/transformer.py imports this module, so no import back)
    tokens: torch.Tensor,
    hidden: torch.Tensor,
    log: MTPLog,
    positions: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
    moe_log: MoELog | None = None,
) -> None:
    """Run every MTP depth over the whole sequence from the main model's final ``hidden`` (B, T, dim) and
    record each depth's logits in ``log`` (training: the inputs of ``tokens`` rolled, see the module doc)."""
    b, t = hidden.shape[0], hidden.shape[1]
    split = model.sequence_split  # a slice of each sequence (context parallelism): global positions
    if positions is None and split is not None:
        positions = split.positions(t, hidden.device)
    ctx = model.context(b, t, 0, positions, document_ids, hidden.device)
    ctx.moe_log, ctx.document_ids, ctx.split = moe_log, document_ids, split
    for depth, module in enumerate(model.mtp.values(), 1):
        layer_ctx = ctx
        if module.block.kind == "G":
            layer_ctx = model.global_context(ctx, t, 0, document_ids, hidden.device)
        hidden = module(hidden, _embeddings_ahead(model, tokens, log, depth), layer_ctx)
        log.logits.append(model.output(module.norm(hidden)))


def mtp_targets(labels: torch.Tensor, loss_mask: torch.Tensor | None, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels, loss mask) of depth ``depth``: the next-token labels rolled left by ``depth``, the last
    ``depth`` positions (whose inputs wrapped around) masked."""
    length = labels.shape[1]
    valid = (torch.arange(length, device=labels.device) < length - depth)[None, :].expand_as(labels)
    mask = valid if loss_mask is None else valid & loss_mask.roll(-depth, dims=1).bool()
    return labels.roll(-depth, dims=1), mask


LossFn = Callable[[torch.Tensor, torch.Tensor, float, "torch.Tensor | None"], torch.Tensor]


def mtp_losses(
    logits: list[torch.Tensor],
    labels: torch.Tensor,
    loss_mask: torch.Tensor | None,
    loss_fn: LossFn,
    label_smoothing: float = 0.0,
) -> list[torch.Tensor]:
    """The mean loss of each depth (``loss_fn(logits, labels, label_smoothing, mask)`` over its targets)."""
    losses = []
    for depth, depth_logits in enumerate(logits, 1):
        depth_labels, mask = mtp_targets(labels, loss_mask, depth)
        losses.append(loss_fn(depth_logits, depth_labels, label_smoothing, mask))
    return losses


def mtp_ahead(tokens: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None, depth: int) -> dict:
    """Every depth's inputs, targets and loss mask over whole sequences, stacked on a last dim (B, T, depth):
    ``mtp_tokens``, ``mtp_labels``, ``mtp_mask``. Cut along the sequence like the other per-token tensors
    (context parallelism), they give each slice what its depths read from positions beyond it."""
    targets = [mtp_targets(labels, loss_mask, k) for k in range(1, depth + 1)]
    return {
        "mtp_tokens": torch.stack([tokens.roll(-k, dims=1) for k in range(1, depth + 1)], dim=-1),
        "mtp_labels": torch.stack([t[0] for t in targets], dim=-1),
        "mtp_mask": torch.stack([t[1] for t in targets], dim=-1),
    }


def mtp_token_counts(labels: torch.Tensor, loss_mask: torch.Tensor | None, depth: int) -> list[int]:
    """How many target tokens each depth ``1..depth`` has in a batch (a pipeline weighs micro-batches by them)."""
    return [int(mtp_targets(labels, loss_mask, k)[1].sum()) for k in range(1, depth + 1)]


SPEC = registry.option(
    name="mtp",
    feature="multi-token prediction",
    keys=("model.mtp_depth",),
    uses=lambda m: bool(m.mtp_depth),
    unsupported={
        "deepspeed": "not validated with the DeepSpeed engine yet; use parallel.engine='torch' (FSDP/DDP/TP/PP)",
    },
    checks=(),
)
