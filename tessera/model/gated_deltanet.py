"""Gated DeltaNet (Yang, Kautz & Hatamizadeh 2025), the linear-attention mixer of Qwen3-Next, in plain PyTorch.

Each head keeps a (key_head_dim x value_head_dim) state ``S`` updated by the gated delta rule

    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,      o_t = S_t^T q_t

with L2-normalized q and k (q also scaled by key_head_dim^-1/2), a per-head decay
``g = -exp(A_log) * softplus(a + dt_bias)`` and a per-token write strength ``beta = sigmoid(b)``.
q, k and v first pass a short causal depthwise convolution (+ SiLU); the output is normalized per
head and gated by ``silu(z)`` (:class:`GatedOutputNorm`), then projected back.

Training runs :func:`chunk_gated_delta_rule`: within a chunk of ``[model.gdn].chunk`` positions
the sequential updates are folded into one unit-lower-triangular solve (the WY / UT
representation), so work and memory grow linearly with the length; the state passes from chunk to
chunk. Decoding runs :func:`recurrent_gated_delta_rule` one token at a time from a fixed-size
:class:`~tessera.model.mamba.MambaCache` (the convolution window and the state).

``document_ids`` (packed documents) reset the state and the convolution window at every boundary,
so a packed row computes what each document would alone.

Parameter names and the fused projection layout follow HF transformers' ``Qwen3NextGatedDeltaNet``
(per key head: q, k, then its group of v and z heads), so checkpoints map 1:1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera import registry
from tessera.config import ModelConfig
from tessera.config.checks import require, require_all
from tessera.model.mamba import MambaCache
from tessera.model.recurrent import (
    Docs,
    RecurrentMixer,
    RecurrentSplit,
    causal_depthwise_conv,
    chunk_document_masks,
    continues_document,
    split_causal_conv,
    split_scan,
)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(|x|^2 + eps)`` over the last dim (the FLA / HF form)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _chunk_masks(docs: torch.Tensor, chunk: int) -> tuple[torch.Tensor, ...]:
    """:func:`chunk_document_masks` of padded ids (B, n*L) as (B, 1, n, ...): the state entering the first chunk
    belongs to the first position's document."""
    ids = docs.view(docs.shape[0], 1, -1, chunk)
    before = torch.cat([docs[:, None, :1], docs[:, None, chunk - 1 : -1 : chunk]], dim=-1)
    return chunk_document_masks(ids, before)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk: int,
    state: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over whole chunks (float32).

    q, k (B, H, T, Dk) normalized and scaled; v (B, H, T, Dv); g (log decay) and beta (B, H, T);
    ``state`` (B, H, Dk, Dv) the entering state (zero when None). Returns the outputs (B, H, T, Dv)
    and the final state.
    """
    batch, heads, length, dk = k.shape
    pad = (-length) % chunk
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (length + pad) // chunk
    q, k, v = (t.reshape(batch, heads, n, chunk, -1) for t in (q, k, v))
    g, beta = g.reshape(batch, heads, n, chunk), beta.reshape(batch, heads, n, chunk)
    cum = g.cumsum(-1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    reads = writes = carries = None
    if document_ids is not None:
        docs = F.pad(document_ids, (0, pad), mode="replicate") if pad else document_ids
        same, reads, writes, carries = _chunk_masks(docs, chunk)
        decay = decay * same
    read_decay = cum.exp() if reads is None else cum.exp() * reads
    write_decay = (cum[..., -1:] - cum).exp() if writes is None else (cum[..., -1:] - cum).exp() * writes
    chunk_decay = cum[..., -1].exp() if carries is None else cum[..., -1].exp() * carries
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # only its strictly lower part is read
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * read_decay[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_read, k_write = q * read_decay[..., None], k * write_decay[..., None]
    s = state.float() if state is not None else q.new_zeros(batch, heads, dk, v.shape[-1])
    outputs = []
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ s  # what the state does not yet predict
        outputs.append(q_read[:, :, i] @ s + attn[:, :, i] @ v_new)
        s = s * chunk_decay[:, :, i, None, None] + k_write[:, :, i].transpose(-1, -2) @ v_new
    out = torch.stack(outputs, dim=2).reshape(batch, heads, n * chunk, -1)[:, :, :length]
    return out, s


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule one position at a time (shapes as :func:`chunk_gated_delta_rule`)."""
    batch, heads, length, dk = k.shape
    s = state.float() if state is not None else q.new_zeros(batch, heads, dk, v.shape[-1])
    continues = continues_document(document_ids) if document_ids is not None else None
    outputs = []
    for t in range(length):
        keep = g[:, :, t].exp()[..., None, None]
        if document_ids is not None:
            keep = keep * continues[:, t, None, None, None]
        s = s * keep
        delta = (v[:, :, t] - (s * k[:, :, t, :, None]).sum(-2)) * beta[:, :, t, None]
        s = s + k[:, :, t, :, None] * delta[:, :, None, :]
        outputs.append((s * q[:, :, t, :, None]).sum(-2))
    return torch.stack(outputs, dim=2), s


def split_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk: int,
    split: RecurrentSplit,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gated delta rule over a split sequence (:func:`~tessera.model.recurrent.split_scan`): a local piece's
    summary is its scan from a zero state and from the identity (one pass: the value columns evolve
    independently), the transition and contribution of S_end = A S_in + H."""
    dk, dv = k.shape[-1], v.shape[-1]

    def piece_docs(p: slice) -> torch.Tensor | None:
        return document_ids[:, p] if document_ids is not None else None

    def summarize(p: slice) -> tuple[torch.Tensor, torch.Tensor]:
        probe = torch.cat([v[:, :, p], v.new_zeros(*v[:, :, p].shape[:-1], dk)], dim=-1)
        eye = torch.eye(dk, device=v.device, dtype=v.dtype).expand(*v.shape[:2], dk, dk)
        start = torch.cat([v.new_zeros(*v.shape[:2], dk, dv), eye], dim=-1)
        final = chunk_gated_delta_rule(
            q[:, :, p], k[:, :, p], probe, g[:, :, p], beta[:, :, p], chunk, start, piece_docs(p)
        )[1]
        return final[..., dv:], final[..., :dv]  # [contribution | transition]

    def scan(p: slice, entering: torch.Tensor) -> torch.Tensor:
        return chunk_gated_delta_rule(
            q[:, :, p], k[:, :, p], v[:, :, p], g[:, :, p], beta[:, :, p], chunk, entering, piece_docs(p)
        )[0]

    return torch.cat(split_scan(split, q.shape[2], summarize, scan, False, document_ids), dim=2)


class GatedOutputNorm(nn.Module):
    """RMSNorm of each head's output, then times ``silu(z)`` (norm before gate, HF ``Qwen3NextRMSNormGated``)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def reset_parameters(self) -> None:
        """Unit gain."""
        nn.init.ones_(self.weight)

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Normalized ``y`` (..., dim) gated by ``z``, in ``y``'s dtype."""
        h = y.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.weight * h.to(y.dtype)) * F.silu(z.float())).to(y.dtype)


class GatedDeltaNet(RecurrentMixer):
    """The Gated DeltaNet token mixer of ``[model.gdn]``: (B, T, dim) -> (B, T, dim).

    Head counts follow the projections' widths, so a tensor-parallel shard that holds whole key-head
    groups needs no bookkeeping.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        g = cfg.gdn
        self.key_head_dim, self.value_head_dim, self.chunk = g.key_head_dim, g.value_head_dim, g.chunk
        self.group = g.value_heads // g.key_heads  # value heads per key head
        key_dim, value_dim = g.key_heads * g.key_head_dim, g.value_heads * g.value_head_dim
        self.conv_dim = 2 * key_dim + value_dim
        self.in_proj_qkvz = nn.Linear(cfg.dim, 2 * key_dim + 2 * value_dim, bias=False)
        self.in_proj_ba = nn.Linear(cfg.dim, 2 * g.value_heads, bias=False)
        channels = self.conv_dim
        self.conv1d = nn.Conv1d(channels, channels, g.conv, groups=channels, padding=g.conv - 1, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(g.value_heads))
        self.A_log = nn.Parameter(torch.empty(g.value_heads))
        self.norm = GatedOutputNorm(g.value_head_dim, cfg.norm_eps)
        self.out_proj = nn.Linear(value_dim, cfg.dim, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """A ~ U(0.01, 16) (log-stored), dt_bias = 1 (HF's initialization)."""
        with torch.no_grad():
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16).log())
            self.dt_bias.fill_(1.0)

    def new_cache(self, batch: int, device: torch.device) -> MambaCache:
        """An empty decoding state: the last ``conv - 1`` inputs of the convolution and each value head's state."""
        heads = self.dt_bias.shape[0]
        shape = (heads, self.key_head_dim, self.value_head_dim)
        return MambaCache(batch, self.conv_dim, self.conv1d.kernel_size[0], shape, device)

    def _split(self, qkvz: torch.Tensor, ba: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """HF's per-key-head layout -> q, k (B, T, Hk, Dk), v, z (B, T, Hv, Dv), b, a (B, T, Hv)."""
        batch, length = qkvz.shape[:2]
        dk, dv, r = self.key_head_dim, self.value_head_dim, self.group
        qkvz = qkvz.view(batch, length, -1, 2 * dk + 2 * r * dv)
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = ba.view(batch, length, -1, 2 * r).split([r, r], dim=-1)
        v, z = v.reshape(batch, length, -1, dv), z.reshape(batch, length, -1, dv)
        return q, k, v, z, b.reshape(batch, length, -1), a.reshape(batch, length, -1)

    def _conv(
        self,
        mixed: torch.Tensor,
        cache: MambaCache | None,
        start: int,
        document_ids: torch.Tensor | None,
        split: RecurrentSplit | None = None,
    ) -> torch.Tensor:
        """silu(causal conv) of (B, C, T); with a cache, continue from its window (restarted at ``start`` = 0)."""
        if split is not None:
            return F.silu(split_causal_conv(mixed, self.conv1d.weight, split, document_ids))
        if cache is None:
            return F.silu(causal_depthwise_conv(mixed, self.conv1d.weight, document_ids))
        if start == 0:
            cache.conv.zero_()
            cache.ssm.zero_()
        full = torch.cat([cache.conv.to(mixed.dtype), mixed], dim=-1)
        cache.conv.copy_(full[..., full.shape[-1] - cache.conv.shape[-1] :])
        return F.silu(F.conv1d(full, self.conv1d.weight, groups=self.conv_dim))

    def mix(self, x: torch.Tensor, cache: MambaCache | None, start: int, docs: Docs, split: RecurrentSplit | None):
        """See :meth:`~tessera.model.recurrent.RecurrentMixer.forward`."""
        document_ids = docs
        batch, length, _ = x.shape
        q, k, v, z, b, a = self._split(self.in_proj_qkvz(x), self.in_proj_ba(x))
        mixed = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1).transpose(1, 2)
        mixed = self._conv(mixed, cache, start, document_ids, split).transpose(1, 2)
        key_dim = q.shape[2] * self.key_head_dim
        q, k, v = mixed.float().split([key_dim, key_dim, v.shape[2] * self.value_head_dim], dim=-1)
        q, k = (l2_normalize(t.view(batch, length, -1, self.key_head_dim)) for t in (q, k))
        q = q * self.key_head_dim**-0.5
        q, k = (t.repeat_interleave(self.group, dim=2).transpose(1, 2) for t in (q, k))
        v = v.view(batch, length, -1, self.value_head_dim).transpose(1, 2)
        beta = b.float().sigmoid().transpose(1, 2)
        g = (-self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())).transpose(1, 2)
        h0 = cache.ssm if cache is not None else None
        if split is not None:
            y, h = split_gated_delta_rule(q, k, v, g, beta, self.chunk, split, document_ids), None
        elif cache is not None and length == 1:
            y, h = recurrent_gated_delta_rule(q, k, v, g, beta, h0)
        else:
            y, h = chunk_gated_delta_rule(q, k, v, g, beta, self.chunk, h0, document_ids)
        if cache is not None:
            cache.ssm.copy_(h)
        y = self.norm(y.transpose(1, 2).to(x.dtype), z)
        return self.out_proj(y.reshape(batch, length, -1))


def check_gated_deltanet(m: ModelConfig) -> None:
    """[model.gdn]: positive widths, and value heads in whole groups per key head."""
    gdn = m.gdn
    widths = ("key_heads", "value_heads", "key_head_dim", "value_head_dim", "conv", "chunk")
    require_all("model.gdn", gdn, widths, positive=True)
    require(
        gdn.value_heads % gdn.key_heads == 0,
        f"model.gdn.value_heads={gdn.value_heads} must be a multiple of model.gdn.key_heads={gdn.key_heads} (each "
        "key head serves a group of value heads)",
    )


def _flops(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token of one layer beyond its projections (which are in 6 * N): the chunked form's
    within-chunk products (q.k and k.k scores, two triangular solves, the score-value product) and the state
    read and write, x3 for forward + backward."""
    g = cfg.gdn
    chunk, dk, dv = min(g.chunk, seq_len), g.key_head_dim, g.value_head_dim
    per_head = 2 * chunk * (2 * dk + 2 * dv + dk) + 2 * 3 * dk * dv
    return 3.0 * g.value_heads * per_head


def _forward(module: nn.Module, h: torch.Tensor, ctx: object, cache: MambaCache | None, start: int) -> torch.Tensor:
    return module(h, cache, start, getattr(ctx, "document_ids", None), getattr(ctx, "split", None))


def _new_cache(module: nn.Module, batch: int, max_len: int, dtype: torch.dtype, device: torch.device) -> MambaCache:
    return module.new_cache(batch, device)


GATED_DELTANET = registry.register(
    registry.MixerSpec(
        name="gated_deltanet",
        feature="Gated DeltaNet layers",
        keys=("model.layer_pattern", "model.gdn"),
        uses=lambda m: "D" in m.layer_pattern,
        unsupported={},  # cp: each rank scans its chunks from zero; summaries combine (parallel/context.py)
        checks=(check_gated_deltanet,),
        terms=registry.Terms(flops=_flops, memory=registry.TRACED),
        # Whole key-head groups per rank; the per-channel convolution, decay and time-step parameters between
        # them are sliced per rank by tessera/parallel/recurrent.py.
        tp_plan={"in_proj_qkvz": "colwise", "in_proj_ba": "colwise", "out_proj": "rowwise"},
        letters={"D": "Gated DeltaNet"},
        attr="gdn",
        recurrent=True,
        build=lambda cfg, layer_id: GatedDeltaNet(cfg),
        forward=_forward,
        new_cache=_new_cache,
    )
)
