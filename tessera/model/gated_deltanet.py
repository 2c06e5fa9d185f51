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


def _per_channel(g: torch.Tensor) -> torch.Tensor:
    """A log decay per head (B, H, T) as (B, H, T, 1); a per-channel one (B, H, T, Dk) as it is."""
    return g[..., None] if g.dim() == 3 else g


def _masked_exp(exponent: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """exp(exponent) where ``keep``, 0 elsewhere (no overflow or NaN gradient from the entries left out)."""
    return torch.where(keep, exponent, float("-inf")).exp()


def decayed_products(a: torch.Tensor, b: torch.Tensor, cum: torch.Tensor, sub: int = 16) -> torch.Tensor:
    """P[..., i, j] = sum_d a_id b_jd exp(cum_id - cum_jd) for j <= i, else 0: a, b (..., L, D), ``cum`` the
    non-increasing cumulative log decay (..., L, 1) (one per head) or (..., L, D) (one per key channel).

    A per-channel decay does not factor out of the product; rather than the (L, L, D) tensor of every pair, the
    chunk is cut into blocks of ``sub``: pairs inside a block use their own decays (sub, sub, D), pairs across
    blocks pass through the row block's first position r (exp(cum_i - cum_r) exp(cum_r - cum_j), both <= 1)."""
    length = a.shape[-2]
    causal = torch.ones(length, length, dtype=torch.bool, device=a.device).tril()
    if cum.shape[-1] == 1:
        c = cum[..., 0]
        return (a @ b.transpose(-1, -2)) * (c[..., :, None] - c[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    s = sub if length % sub == 0 else length
    n = length // s
    a, b, cum = (t.unflatten(-2, (n, s)) for t in (a, b, cum))  # (..., n, s, D)
    inner = _masked_exp(cum[..., :, None, :] - cum[..., None, :, :], causal[:s, :s, None])
    diagonal = (a[..., :, None, :] * b[..., None, :, :] * inner).sum(-1)  # (..., n, s, s)
    ref = cum[..., :1, :]  # each block's first position
    earlier = torch.ones(n, n, dtype=torch.bool, device=a.device).tril(-1)[:, :, None, None]
    b_ref = b[..., None, :, :, :] * _masked_exp(ref[..., :, None, :, :] - cum[..., None, :, :, :], earlier)
    across = torch.einsum("...Iid,...IJjd->...IiJj", a * (cum - ref).exp(), b_ref)  # (..., n, s, n, s)
    eye = torch.eye(n, dtype=a.dtype, device=a.device)[:, None, :, None]
    return (across + diagonal[..., :, :, None, :] * eye).flatten(-4, -3).flatten(-2, -1)


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

    q, k (B, H, T, Dk) normalized and scaled; v (B, H, T, Dv); beta (B, H, T); g the log decay, one per head
    (B, H, T) (Gated DeltaNet) or one per key channel (B, H, T, Dk) (Kimi Delta Attention); ``state``
    (B, H, Dk, Dv) the entering state (zero when None). Returns the outputs (B, H, T, Dv) and the final state.
    """
    batch, heads, length, dk = k.shape
    pad = (-length) % chunk
    g = _per_channel(g)
    q, k, v, g = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, g))
    n = (length + pad) // chunk
    q, k, v, g = (t.reshape(batch, heads, n, chunk, -1) for t in (q, k, v, g))
    beta = F.pad(beta, (0, pad)).reshape(batch, heads, n, chunk, 1)
    cum = g.cumsum(-2)
    read_decay, write_decay, chunk_decay = cum.exp(), (cum[..., -1:, :] - cum).exp(), cum[..., -1, :].exp()
    same = None
    if document_ids is not None:
        docs = F.pad(document_ids, (0, pad), mode="replicate") if pad else document_ids
        same, reads, writes, carries = _chunk_masks(docs, chunk)
        read_decay, write_decay = read_decay * reads[..., None], write_decay * writes[..., None]
        chunk_decay = chunk_decay * carries[..., None]
    k_beta = k * beta
    system = decayed_products(k_beta, k, cum)  # only its strictly lower part is read
    attn = decayed_products(q, k, cum)
    if same is not None:
        system, attn = system * same, attn * same
    u = torch.linalg.solve_triangular(system, v * beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * read_decay, upper=False, unitriangular=True)
    q_read, k_write = q * read_decay, k * write_decay
    s = state.float() if state is not None else q.new_zeros(batch, heads, dk, v.shape[-1])
    outputs = []
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ s  # what the state does not yet predict
        outputs.append(q_read[:, :, i] @ s + attn[:, :, i] @ v_new)
        s = s * chunk_decay[:, :, i, :, None] + k_write[:, :, i].transpose(-1, -2) @ v_new
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
    g = _per_channel(g)
    outputs = []
    for t in range(length):
        keep = g[:, :, t].exp()[..., None]  # (B, H, 1 or Dk, 1): the decay of each key row of the state
        if document_ids is not None:
            keep = keep * continues[:, t, None, None, None]
        s = s * keep
        delta = (v[:, :, t] - (s * k[:, :, t, :, None]).sum(-2)) * beta[:, :, t, None]
        s = s + k[:, :, t, :, None] * delta[:, :, None, :]
        outputs.append((s * q[:, :, t, :, None]).sum(-2))
    return torch.stack(outputs, dim=2), s


def split_gated_delta_rule(
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    gates: tuple[torch.Tensor, torch.Tensor],
    chunk: int,
    split: RecurrentSplit,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gated delta rule over a split sequence (:func:`~tessera.model.recurrent.split_scan`): a local piece's
    summary is its scan from a zero state and from the identity (one pass: the value columns evolve
    independently), the transition and contribution of S_end = A S_in + H."""
    (q, k, v), (g, beta) = qkv, gates
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
    """RMSNorm of each head's output, then times ``act(z)`` (norm before gate): ``silu`` as HF's
    ``Qwen3NextRMSNormGated``, ``sigmoid`` as ``KimiLinearRMSNormGated``."""

    def __init__(self, dim: int, eps: float, gate: str = "silu") -> None:
        super().__init__()
        self.gate = gate  # "silu" (Qwen3-Next) or "sigmoid" (Kimi Linear)
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def reset_parameters(self) -> None:
        """Unit gain."""
        nn.init.ones_(self.weight)

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Normalized ``y`` (..., dim) gated by ``z``, in ``y``'s dtype."""
        h = y.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        gate = F.silu(z.float()) if self.gate == "silu" else torch.sigmoid(z.float())
        return ((self.weight * h.to(y.dtype)) * gate).to(y.dtype)


class DeltaRuleMixer(RecurrentMixer):
    """What the delta-rule mixers (Gated DeltaNet, Kimi Delta Attention) share: q, k and v through one causal
    depthwise convolution (+ SiLU), L2-normalized q and k (q scaled by key_head_dim^-1/2), the delta rule in its
    chunked, recurrent (decoding from a :class:`MambaCache`) or split (context parallel) form.

    A subclass sets ``key_head_dim``, ``value_head_dim``, ``chunk``, ``group`` (value heads per key head),
    ``state_heads`` and ``conv_dim``, and says what the convolution's weight is (``conv_weight``), how x becomes q,
    k, v (``_project``), the log decay and the write strength (``_gates``) and the output (``_output``). Head
    counts follow the projections' widths, so a tensor-parallel shard that holds whole heads needs no bookkeeping.
    """

    title: str  # what the compatibility table and the layer-pattern letters call it
    key_head_dim: int
    value_head_dim: int
    chunk: int
    group: int
    state_heads: int
    conv_dim: int

    def conv_weight(self) -> torch.Tensor:
        """The depthwise convolution's weight (conv_dim, 1, width) over the channels [q | k | v]."""
        raise NotImplementedError

    def new_cache(self, batch: int, device: torch.device) -> MambaCache:
        """An empty decoding state: the last ``conv - 1`` inputs of the convolution and each value head's state."""
        shape = (self.state_heads, self.key_head_dim, self.value_head_dim)
        return MambaCache(batch, self.conv_dim, self.conv_weight().shape[-1], shape, device)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, object]:
        """(B, T, dim) -> q, k (B, T, key width), v (B, T, value width) and what the gates and output read."""
        raise NotImplementedError

    def _gates(self, x: torch.Tensor, extras: object) -> tuple[torch.Tensor, torch.Tensor]:
        """The log decay (B, H, T) or (B, H, T, Dk) and the write strength beta (B, H, T), float32."""
        raise NotImplementedError

    def _output(self, y: torch.Tensor, extras: object) -> torch.Tensor:
        """The rule's output (B, T, H, Dv) -> the mixer's (B, T, dim)."""
        raise NotImplementedError

    def _conv(
        self,
        mixed: torch.Tensor,
        cache: MambaCache | None,
        start: int,
        document_ids: Docs,
        split: RecurrentSplit | None,
    ) -> torch.Tensor:
        """silu(causal conv) of (B, C, T); with a cache, continue from its window (restarted at ``start`` = 0)."""
        weight = self.conv_weight()
        if split is not None:
            return F.silu(split_causal_conv(mixed, weight, split, document_ids))
        if cache is None:
            return F.silu(causal_depthwise_conv(mixed, weight, document_ids))
        if start == 0:
            cache.conv.zero_()
            cache.ssm.zero_()
        full = torch.cat([cache.conv.to(mixed.dtype), mixed], dim=-1)
        cache.conv.copy_(full[..., full.shape[-1] - cache.conv.shape[-1] :])
        return F.silu(F.conv1d(full, weight, groups=mixed.shape[1]))

    def mix(self, x: torch.Tensor, cache: MambaCache | None, start: int, docs: Docs, split: RecurrentSplit | None):
        """See :meth:`~tessera.model.recurrent.RecurrentMixer.forward`."""
        batch, length, _ = x.shape
        q, k, v, extras = self._project(x)
        widths = [q.shape[-1], k.shape[-1], v.shape[-1]]
        mixed = self._conv(torch.cat([q, k, v], dim=-1).transpose(1, 2), cache, start, docs, split)
        q, k, v = mixed.transpose(1, 2).float().split(widths, dim=-1)
        q, k = (l2_normalize(t.view(batch, length, -1, self.key_head_dim)) for t in (q, k))
        q = q * self.key_head_dim**-0.5
        q, k = (t.repeat_interleave(self.group, dim=2).transpose(1, 2) for t in (q, k))
        v = v.view(batch, length, -1, self.value_head_dim).transpose(1, 2)
        y = self._scan((q, k, v), self._gates(x, extras), cache, docs, split)
        return self._output(y.transpose(1, 2).to(x.dtype), extras)

    def _scan(
        self,
        qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        gates: tuple[torch.Tensor, torch.Tensor],
        cache: MambaCache | None,
        document_ids: Docs,
        split: RecurrentSplit | None,
    ) -> torch.Tensor:
        q, k, v = qkv
        if split is not None:
            return split_gated_delta_rule(qkv, gates, self.chunk, split, document_ids)
        h0 = cache.ssm if cache is not None else None
        if cache is not None and q.shape[2] == 1:
            y, h = recurrent_gated_delta_rule(q, k, v, *gates, h0)
        else:
            y, h = chunk_gated_delta_rule(q, k, v, *gates, self.chunk, h0, document_ids)
        if cache is not None:
            cache.ssm.copy_(h)
        return y


class GatedDeltaNet(DeltaRuleMixer):
    """The Gated DeltaNet token mixer of ``[model.gdn]``: (B, T, dim) -> (B, T, dim)."""

    title = "Gated DeltaNet"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        g = cfg.gdn
        self.key_head_dim, self.value_head_dim, self.chunk = g.key_head_dim, g.value_head_dim, g.chunk
        self.group, self.state_heads = g.value_heads // g.key_heads, g.value_heads
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

    def conv_weight(self) -> torch.Tensor:
        """One convolution over [q | k | v] (HF's ``conv1d``)."""
        return self.conv1d.weight

    def reset_parameters(self) -> None:
        """A ~ U(0.01, 16) (log-stored), dt_bias = 1 (HF's initialization)."""
        with torch.no_grad():
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16).log())
            self.dt_bias.fill_(1.0)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, object]:
        """HF's per-key-head layout of the fused projections -> q, k, v and (z (B, T, Hv, Dv), b, a (B, T, Hv))."""
        batch, length = x.shape[:2]
        dk, dv, r = self.key_head_dim, self.value_head_dim, self.group
        qkvz = self.in_proj_qkvz(x).view(batch, length, -1, 2 * dk + 2 * r * dv)
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = self.in_proj_ba(x).view(batch, length, -1, 2 * r).split([r, r], dim=-1)
        z = z.reshape(batch, length, -1, dv)
        return q.flatten(2), k.flatten(2), v.flatten(2), (z, b.reshape(batch, length, -1), a.reshape(batch, length, -1))

    def _gates(self, x: torch.Tensor, extras: object) -> tuple[torch.Tensor, torch.Tensor]:
        """One log decay per head ``-exp(A_log) softplus(a + dt_bias)`` and ``beta = sigmoid(b)``, (B, Hv, T)."""
        _, b, a = extras
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return g.transpose(1, 2), b.float().sigmoid().transpose(1, 2)

    def _output(self, y: torch.Tensor, extras: object) -> torch.Tensor:
        """Each head normalized and gated by ``silu(z)``, then ``out_proj``."""
        return self.out_proj(self.norm(y, extras[0]).flatten(2))


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


def delta_rule_flops(heads: int, dk: int, dv: int, chunk: int) -> float:
    """Training FLOPs per token of one delta-rule layer beyond its projections (which are in 6 * N): the chunked
    form's within-chunk products (q.k and k.k scores, two triangular solves, the score-value product) and the
    state read and write, x3 for forward + backward."""
    per_head = 2 * chunk * (2 * dk + 2 * dv + dk) + 2 * 3 * dk * dv
    return 3.0 * heads * per_head


def _flops(cfg: ModelConfig, seq_len: int) -> float:
    g = cfg.gdn
    return delta_rule_flops(g.value_heads, g.key_head_dim, g.value_head_dim, min(g.chunk, seq_len))


def recurrent_forward(
    module: nn.Module, h: torch.Tensor, ctx: object, cache: MambaCache | None, start: int
) -> torch.Tensor:
    """A delta-rule mixer's registered forward: the packed documents and sequence split of the block's context."""
    return module(h, cache, start, getattr(ctx, "document_ids", None), getattr(ctx, "split", None))


def new_state_cache(
    module: nn.Module, batch: int, max_len: int, dtype: torch.dtype, device: torch.device
) -> MambaCache:
    """A delta-rule mixer's registered cache: fixed-size, whatever ``max_len``."""
    return module.new_cache(batch, device)


def register_delta_rule_mixer(
    name: str,
    letter: str,
    section: str,
    mixer: type[DeltaRuleMixer],
    checks: tuple,
    flops: object,
    tp_plan: dict[str, str],
) -> registry.MixerSpec:
    """Register a delta-rule mixer: the ``model.layer_pattern`` letter it serves, built from ``[model.<section>]``
    and sitting at the block's ``<section>`` attribute. Every layout works: under cp each rank scans its chunks
    from zero and the chunk summaries combine (parallel/context.py); under tp whole heads per rank, the
    per-channel convolution, decay and time-step parameters between the projections sliced per rank by
    tessera/parallel/recurrent.py."""
    return registry.register(
        registry.MixerSpec(
            name=name,
            feature=f"{mixer.title} layers",
            keys=("model.layer_pattern", f"model.{section}"),
            uses=lambda m: letter in m.layer_pattern,
            unsupported={},
            checks=checks,
            terms=registry.Terms(flops=flops, memory=registry.TRACED),
            tp_plan=tp_plan,
            letters={letter: mixer.title},
            attr=section,
            recurrent=True,
            build=lambda cfg, layer_id: mixer(cfg),
            forward=recurrent_forward,
            new_cache=new_state_cache,
        )
    )


GATED_DELTANET = register_delta_rule_mixer(
    "gated_deltanet",
    "D",
    "gdn",
    GatedDeltaNet,
    (check_gated_deltanet,),
    _flops,
    {"in_proj_qkvz": "colwise", "in_proj_ba": "colwise", "out_proj": "rowwise"},
)
