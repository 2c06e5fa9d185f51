"""``linear`` (elu + 1) and ``performer`` (FAVOR+ random features): the softmax replaced by a kernel
feature map, so attention is prefix sums over keys (causal) or one sum (bidirectional). No score
matrix: no masks, windows, score biases or document masks.

Under context parallelism (``AttnContext.split``) the causal prefix sums are a recurrence whose state is
(sum phi(k) v^T, sum phi(k)) with an identity transition: each rank sums its pieces, the sums are combined in
sequence order (:func:`tessera.model.recurrent.split_scan`) and each piece continues from the sum before it."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tessera.config.checks import require
from tessera.model.kernels.common import AttentionLayer, AttnContext, SOFTMAX_TERMS, repeat_kv
from tessera.model.recurrent import RecurrentSplit, split_scan
from tessera.registry import ATTENTION_TP, KernelSpec, register, uses_kernel


class PerformerFeatures(nn.Module):
    """FAVOR+ positive orthogonal random features (Choromanski et al. 2021) for one head size."""

    def __init__(self, head_dim: int, n_features: int) -> None:
        super().__init__()
        self.head_dim, self.n_features = head_dim, n_features
        self.register_buffer("projection", torch.empty(n_features, head_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw blocks of orthogonal rows, scaled to the norms of Gaussian vectors."""
        d = self.head_dim
        blocks = []
        for _ in range(-(-self.n_features // d)):
            q, _ = torch.linalg.qr(torch.randn(d, d, device=self.projection.device))
            blocks.append(q.T)
        rows = torch.cat(blocks)[: self.n_features]
        norms = torch.randn(self.n_features, d, device=self.projection.device).norm(dim=-1, keepdim=True)
        with torch.no_grad():
            self.projection.copy_(rows * norms)

    def forward(self, x: torch.Tensor, is_query: bool, split: RecurrentSplit | None = None) -> torch.Tensor:
        """phi(x) = exp(w.x - |x|^2 / 2) / sqrt(m), with x scaled by d^-1/4 and a cancelling stabilizer (the keys'
        over every piece of a ``split`` sequence)."""
        x = x.float() * self.head_dim**-0.25
        proj = x @ self.projection.T
        sq = x.pow(2).sum(-1, keepdim=True) / 2
        # Subtracting a max per query row, or one max over all keys, cancels in numerator / denominator (a
        # constant: no gradient through it).
        stab = proj.amax(dim=-1, keepdim=True) if is_query else proj.amax(dim=(-1, -2), keepdim=True).detach()
        if split is not None and not is_query:
            stab = split.maximum(stab)
        return torch.exp(proj - sq - stab) / math.sqrt(self.n_features) + 1e-6


def linear_attention(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """sum_j phi(q_i).phi(k_j) v_j / sum_j phi(q_i).phi(k_j), over j <= i when causal (prefix sums)."""
    v = v.float()
    if not causal:
        kv = torch.einsum("bhtf,bhtd->bhfd", phi_k, v)
        num = torch.einsum("bhtf,bhfd->bhtd", phi_q, kv)
        den = torch.einsum("bhtf,bhf->bht", phi_q, phi_k.sum(2))
    else:
        q_len = phi_q.shape[2]
        kv = torch.einsum("bhtf,bhtd->bhtfd", phi_k, v).cumsum(2)[:, :, -q_len:]
        num = torch.einsum("bhtf,bhtfd->bhtd", phi_q, kv)
        den = torch.einsum("bhtf,bhtf->bht", phi_q, phi_k.cumsum(2)[:, :, -q_len:])
    return num / den[..., None].clamp_min(1e-12)


def split_linear_attention(
    phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, split: RecurrentSplit
) -> torch.Tensor:
    """Causal :func:`linear_attention` of a split sequence's local queries and keys: the state (B, H, F, D + 1)
    is [sum phi(k) v^T | sum phi(k)] (the last value column a one: the denominator), the transition one."""
    v1 = torch.cat([v.float(), v.new_ones(*v.shape[:-1], 1, dtype=torch.float32)], dim=-1)

    def summarize(p: slice) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.einsum("bhtf,bhtd->bhfd", phi_k[:, :, p], v1[:, :, p])
        return h.new_ones(*h.shape[:2], 1, 1), h

    def scan(p: slice, entering: torch.Tensor) -> torch.Tensor:
        kv = torch.einsum("bhtf,bhtd->bhtfd", phi_k[:, :, p], v1[:, :, p]).cumsum(2) + entering[:, :, None]
        return torch.einsum("bhtf,bhtfd->bhtd", phi_q[:, :, p], kv)

    out = torch.cat(split_scan(split, phi_q.shape[2], summarize, scan, True), dim=2)
    return out[..., :-1] / out[..., -1].clamp_min(1e-12)[..., None]


def linear_attend(
    layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttnContext, dropout: float
) -> torch.Tensor:
    """phi(q), phi(k) by the layer's feature map (``layer.features``, else elu + 1), then prefix sums."""
    if ctx.mask is not None or ctx.bias is not None:
        raise ValueError(
            f"model.attention='{layer.kernel}' supports only causal or full attention (no document_ids, windows or "
            "score biases)"
        )
    k, v = repeat_kv(q, k, v)
    split = ctx.split if ctx.causal else None  # under context parallelism (parallel/context.py)
    if layer.features is not None:
        phi_q, phi_k = layer.features(q, is_query=True), layer.features(k, is_query=False, split=split)
    else:
        phi_q, phi_k = F.elu(q.float()) + 1, F.elu(k.float()) + 1
    if split is not None:
        return split_linear_attention(phi_q, phi_k, v, split).to(q.dtype)
    if layer.weights_observer is not None:  # the implicit weights phi(q).phi(k) / sum_k, exactly as applied
        scores = phi_q @ phi_k.transpose(-2, -1)
        scores = scores.tril(scores.shape[-1] - scores.shape[-2]) if ctx.causal else scores
        layer.weights_observer(scores / scores.sum(-1, keepdim=True).clamp_min(1e-12))
    return linear_attention(phi_q, phi_k, v, ctx.causal).to(q.dtype)


def check_feature_map(m: Any) -> None:
    """A feature-map kernel has no score matrix: no score bias, no sliding window."""
    a = m.attention
    require(
        m.position.kind in ("rope", "learned", "sinusoidal", "none"),
        f"model.attention.kernel='{a.kernel}' cannot add a score bias; model.position.kind='{m.position.kind}' needs "
        "a softmax kernel (sdpa or eager)",
    )
    require(
        a.sliding_window == 0,
        f"model.attention.sliding_window needs a softmax kernel, not model.attention.kernel='{a.kernel}'",
    )


def performer_state(cfg: Any, head_dim: int) -> PerformerFeatures:
    """The random features one attention layer keeps (a buffer: checkpointed, never trained)."""
    return PerformerFeatures(head_dim, cfg.attention.performer_features)


FEATURE = "linear attention kernels (linear, performer)"
UNSUPPORTED: dict[str, str] = {}  # cp: the prefix sums' state is combined over the ranks (split_linear_attention)

LINEAR = register(
    KernelSpec(
        name="linear",
        feature=FEATURE,
        keys=("model.attention.kernel",),
        uses=uses_kernel("linear"),
        unsupported=UNSUPPORTED,
        checks=(check_feature_map,),
        terms=SOFTMAX_TERMS,  # the planner counts the flash-style terms (unchanged from before the registry)
        tp_plan=ATTENTION_TP,
        attend=linear_attend,
        scores=False,
    )
)

PERFORMER = register(
    KernelSpec(
        name="performer",
        feature=FEATURE,
        keys=("model.attention.kernel", "model.attention.performer_features"),
        uses=uses_kernel("performer"),
        unsupported=UNSUPPORTED,
        checks=(check_feature_map,),
        terms=SOFTMAX_TERMS,
        tp_plan=ATTENTION_TP,
        attend=linear_attend,
        scores=False,
        state=performer_state,
    )
)
