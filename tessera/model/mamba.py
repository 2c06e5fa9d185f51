"""Selective state-space mixers: Mamba (Gu & Dao 2023) and Mamba-2 (SSD, Dao & Gu 2024), plain PyTorch.

Both read a (B, T, dim) sequence through an input projection, a causal depthwise convolution and
a selective scan ``h_t = exp(dt_t * A) h_{t-1} + dt_t B_t x_t, y_t = C_t . h_t + D x_t``, gated by
``silu(z)`` and projected back. Training runs the scan in parallel within chunks of
``[model.mamba].chunk`` positions (a doubling prefix scan for Mamba-1, the SSD block
decomposition for Mamba-2) and carries the state across chunks; generation feeds the same code
one token at a time from a :class:`MambaCache` (the convolution window and the SSM state), so a
layer's memory during decoding does not grow with the context.

Parameter names follow HF transformers' ``MambaMixer`` / ``Mamba2Mixer`` so checkpoints map 1:1.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tessera import registry
from tessera.config import ModelConfig
from tessera.config.checks import require, require_all
from tessera.model.norm import RMSNorm
from tessera.model.recurrent import causal_depthwise_conv, chunk_document_masks, continues_document
from tessera.model.recurrent import Docs, MambaCache, RecurrentMixer, RecurrentSplit, split_causal_conv, split_scan


def causal_conv(
    x: torch.Tensor,
    conv: nn.Conv1d,
    cache: MambaCache | None,
    start: int,
    document_ids: torch.Tensor | None = None,
    split: RecurrentSplit | None = None,
) -> torch.Tensor:
    """silu(depthwise causal conv) of ``x`` (B, C, T); with a cache, continue from its window at ``start``;
    with ``document_ids`` (B, T), restart the window at every document boundary; with ``split``, ``x`` is this
    forward's part of each sequence (the windows start with the inputs before each piece)."""
    width = conv.kernel_size[0]
    if split is not None:
        return F.silu(split_causal_conv(x, conv.weight, split, document_ids, conv.bias))
    if cache is None and document_ids is not None:
        out = causal_depthwise_conv(x, conv.weight, document_ids)
        return F.silu(out + conv.bias[:, None] if conv.bias is not None else out)
    if cache is None:  # groups from the input: a tensor-parallel rank convolves only its channels
        return F.silu(F.conv1d(F.pad(x, (width - 1, 0)), conv.weight, conv.bias, groups=x.shape[1]))
    if start == 0:
        cache.conv.zero_()
        cache.ssm.zero_()
    full = torch.cat([cache.conv.to(x.dtype), x], dim=-1)
    cache.conv.copy_(full[..., full.shape[-1] - (width - 1) :])
    return F.silu(F.conv1d(full, conv.weight, conv.bias, groups=x.shape[1]))


def prefix_scan(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inclusive scan of ``h_t = a_t h_{t-1} + b_t`` along dim 1 from h = 0, by doubling (log2 T steps).

    Returns the cumulative products of ``a`` and the states.
    """
    offset, length = 1, a.shape[1]
    while offset < length:
        b = torch.cat([b[:, :offset], b[:, offset:] + a[:, offset:] * b[:, :-offset]], dim=1)
        a = torch.cat([a[:, :offset], a[:, offset:] * a[:, :-offset]], dim=1)
        offset *= 2
    return a, b


def selective_scan(
    decay: torch.Tensor, inputs: torch.Tensor, c: torch.Tensor, h0: torch.Tensor | None, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-1 scan: states ``h_t = decay_t * h_{t-1} + inputs_t`` (B, T, E, N), outputs ``h_t . c_t`` (B, T, E).

    Chunks of ``chunk`` positions are scanned in parallel; the last state of one starts the next.
    Returns the outputs and the final state (B, E, N).
    """
    outputs, h = [], h0
    for s in range(0, decay.shape[1], chunk):
        cum, states = prefix_scan(decay[:, s : s + chunk], inputs[:, s : s + chunk])
        if h is not None:
            states = states + cum * h[:, None]
        outputs.append(torch.einsum("bten,btn->bte", states, c[:, s : s + chunk]))
        h = states[:, -1]
    return torch.cat(outputs, dim=1), h


def split_selective_scan(
    decay: torch.Tensor,
    inputs: torch.Tensor,
    c: torch.Tensor,
    chunk: int,
    split: RecurrentSplit,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`selective_scan` over a split sequence (:func:`~tessera.model.recurrent.split_scan`): a piece's
    transition is the product of its decays (zero past a document boundary), its contribution its final state
    from zero."""

    def piece_decay(p: slice) -> torch.Tensor:
        if document_ids is None:
            return decay[:, p]
        return decay[:, p] * continues_document(document_ids[:, p])[..., None, None]

    def summarize(p: slice) -> tuple[torch.Tensor, torch.Tensor]:
        d = piece_decay(p)
        return d.prod(1), selective_scan(d, inputs[:, p], c[:, p], None, chunk)[1]

    def scan(p: slice, entering: torch.Tensor) -> torch.Tensor:
        return selective_scan(piece_decay(p), inputs[:, p], c[:, p], entering, chunk)[0]

    return torch.cat(split_scan(split, decay.shape[1], summarize, scan, True, document_ids), dim=1)


class MambaMixer(RecurrentMixer):
    """Mamba-1: a state of ``state`` channels per inner channel, input-dependent dt, B and C."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        m = cfg.mamba
        self.inner, self.state, self.chunk = m.expand * cfg.dim, m.state, m.chunk
        self.dt_rank = m.dt_rank or math.ceil(cfg.dim / 16)
        self.in_proj = nn.Linear(cfg.dim, 2 * self.inner, bias=m.proj_bias)
        self.conv1d = nn.Conv1d(self.inner, self.inner, m.conv, groups=self.inner, padding=m.conv - 1, bias=m.conv_bias)
        self.x_proj = nn.Linear(self.inner, self.dt_rank + 2 * m.state, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, self.inner, bias=True)
        self.A_log = nn.Parameter(torch.empty(self.inner, m.state))
        self.D = nn.Parameter(torch.empty(self.inner))
        self.out_proj = nn.Linear(self.inner, cfg.dim, bias=m.proj_bias)
        norms = m.dt_norm  # Jamba normalizes the time step, B and C
        self.dt_layernorm = RMSNorm(self.dt_rank, cfg.norm_eps) if norms else None
        self.b_layernorm = RMSNorm(m.state, cfg.norm_eps) if norms else None
        self.c_layernorm = RMSNorm(m.state, cfg.norm_eps) if norms else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """S4D-real A (A_n = -n), D = 1, dt weights U(+-dt_rank^-0.5) and a dt bias whose softplus spans
        [0.001, 0.1] log-uniformly (Gu & Dao)."""
        with torch.no_grad():
            n = torch.arange(1, self.state + 1, dtype=torch.float32, device=self.A_log.device)
            self.A_log.copy_(n.log().expand(self.inner, -1))
            self.D.fill_(1.0)
            nn.init.uniform_(self.dt_proj.weight, -(self.dt_rank**-0.5), self.dt_rank**-0.5)
            self.dt_proj.bias.copy_(_inverse_softplus_dt(self.inner, self.dt_proj.bias.device))

    def new_cache(self, batch: int, device: torch.device) -> MambaCache:
        """An empty decoding state for ``batch`` sequences."""
        return MambaCache(batch, self.inner, self.conv1d.kernel_size[0], (self.inner, self.state), device)

    def mix(self, x: torch.Tensor, cache: MambaCache | None, start: int, docs: Docs, split: RecurrentSplit | None):
        """See :meth:`~tessera.model.recurrent.RecurrentMixer.forward`."""
        document_ids = docs
        u, z = self.in_proj(x).transpose(1, 2).chunk(2, dim=1)
        u = causal_conv(u, self.conv1d, cache, start, document_ids, split).transpose(1, 2)  # (B, T, E)
        dt, b, c = self.x_proj(u).split([self.dt_rank, self.state, self.state], dim=-1)
        if self.dt_layernorm is not None:
            dt, b, c = self.dt_layernorm(dt), self.b_layernorm(b), self.c_layernorm(c)
        dt = F.softplus(self.dt_proj(dt).float())  # (B, T, E)
        a = -torch.exp(self.A_log.float())  # (E, N)
        decay = torch.exp(dt[..., None] * a)
        inputs = (dt * u.float())[..., None] * b.float()[:, :, None, :]
        if split is not None:
            y = split_selective_scan(decay, inputs, c.float(), self.chunk, split, document_ids)
            y = (y + u.float() * self.D.float()) * F.silu(z.transpose(1, 2).float())
            return self.out_proj(y.to(x.dtype))
        if document_ids is not None:  # a zero decay at a document's first position forgets the state exactly
            decay = decay * continues_document(document_ids)[..., None, None]
        h0 = cache.ssm if cache is not None else None
        y, h = selective_scan(decay, inputs, c.float(), h0, self.chunk)
        if cache is not None:
            cache.ssm.copy_(h)
        y = (y + u.float() * self.D.float()) * F.silu(z.transpose(1, 2).float())
        return self.out_proj(y.to(x.dtype))


def _inverse_softplus_dt(n: int, device: torch.device, low: float = 1e-3, high: float = 0.1) -> torch.Tensor:
    dt = torch.exp(torch.rand(n, device=device) * (math.log(high) - math.log(low)) + math.log(low)).clamp(min=1e-4)
    return dt + torch.log(-torch.expm1(-dt))


def ssd_scan(
    x: torch.Tensor,
    log_decay: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    h0: torch.Tensor | None,
    chunk: int,
    document_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-2 scan with a scalar decay per head: ``h_t = exp(log_decay_t) h_{t-1} + b_t x_t^T``, ``y_t = h_t c_t``.

    x (B, T, H, P) (already times dt), log_decay (B, T, H), b and c (B, T, H, N). Within a chunk
    the outputs are one masked (T x T) product, like attention; states pass between chunks.
    ``document_ids`` (B, T) keep every term within its document. Returns y (B, T, H, P) and the final state
    (B, H, P, N).
    """
    batch, _, heads, p = x.shape
    h = h0 if h0 is not None else x.new_zeros(batch, heads, p, b.shape[-1])
    outputs = []
    for s in range(0, x.shape[1], chunk):
        xc, ac, bc, cc = (t[:, s : s + chunk] for t in (x, log_decay, b, c))
        seg = torch.exp(_segment_sum(ac.transpose(1, 2)))  # (B, H, L, L)
        cum = ac.cumsum(1)  # (B, L, H)
        reads, to_end, carry = torch.exp(cum), torch.exp(cum[:, -1:] - cum), torch.exp(cum[:, -1])
        if document_ids is not None:  # no term crosses a document boundary
            same, read, write, carries = chunk_document_masks(
                document_ids[:, s : s + chunk], document_ids[:, max(s - 1, 0)]
            )
            seg, reads = seg * same[:, None], reads * read[..., None]
            to_end, carry = to_end * write[..., None], carry * carries[:, None]
        scores = torch.einsum("blhn,bshn->bhls", cc, bc) * seg
        y = torch.einsum("bhls,bshp->blhp", scores, xc)
        y = y + torch.einsum("blhn,bhpn->blhp", cc, h) * reads[..., None]
        h = h * carry[..., None, None] + torch.einsum("blhn,blhp->bhpn", bc * to_end[..., None], xc)
        outputs.append(y)
    return torch.cat(outputs, dim=1), h


def split_ssd_scan(
    x: torch.Tensor,
    log_decay: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    chunk: int,
    split: RecurrentSplit,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`ssd_scan` over a split sequence (:func:`~tessera.model.recurrent.split_scan`): a piece's transition
    is its total decay per head (zero when a document starts inside it), its contribution its final state from
    zero."""

    def docs(p: slice) -> torch.Tensor | None:
        return document_ids[:, p] if document_ids is not None else None

    def summarize(p: slice) -> tuple[torch.Tensor, torch.Tensor]:
        total = log_decay[:, p].sum(1).exp()  # (B, H)
        if document_ids is not None:
            total = total * (document_ids[:, p] == document_ids[:, p][:, :1]).all(1)[:, None]
        return total[..., None, None], ssd_scan(x[:, p], log_decay[:, p], b[:, p], c[:, p], None, chunk, docs(p))[1]

    def scan(p: slice, entering: torch.Tensor) -> torch.Tensor:
        return ssd_scan(x[:, p], log_decay[:, p], b[:, p], c[:, p], entering, chunk, docs(p))[0]

    return torch.cat(split_scan(split, x.shape[1], summarize, scan, True, document_ids), dim=1)


def _segment_sum(a: torch.Tensor) -> torch.Tensor:
    """(..., L) -> (..., L, L): out[l, s] = a[s+1] + ... + a[l] for s <= l, -inf above the diagonal.

    Summed by a masked cumulative sum rather than as a difference of prefix sums, which would
    lose precision once the prefix sums grow large.
    """
    length = a.shape[-1]
    ones = torch.ones(length, length, dtype=torch.bool, device=a.device)
    sums = a[..., :, None].expand(*a.shape, length).masked_fill(~ones.tril(-1), 0.0).cumsum(-2)
    return sums.masked_fill(~ones.tril(), -torch.inf)


class GatedRMSNorm(nn.Module):
    """Mamba-2's output norm: RMSNorm(y * silu(z)) over groups of ``dim / groups`` channels (HF's
    ``MambaRMSNormGated``: one group per B/C group; a tensor-parallel rank normalizes its whole groups)."""

    def __init__(self, dim: int, groups: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size, self.eps = dim // groups, eps

    def reset_parameters(self) -> None:
        """Unit gain."""
        nn.init.ones_(self.weight)

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Normalized gated ``y`` (..., dim) in ``y``'s dtype."""
        h = y.float() * F.silu(z.float())
        g = h.view(*h.shape[:-1], -1, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view(h.shape).to(y.dtype)


class Mamba2Mixer(RecurrentMixer):
    """Mamba-2: heads of ``head_dim`` channels, one scalar decay per head, B/C shared within groups."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        m = cfg.mamba
        self.inner, self.state, self.chunk, self.groups = m.expand * cfg.dim, m.state, m.chunk, m.groups
        self.head_dim, self.dt_min = m.head_dim, m.dt_min
        self.heads = self.inner // m.head_dim
        self.conv_dim = self.inner + 2 * m.groups * m.state
        self.in_proj = nn.Linear(cfg.dim, self.inner + self.conv_dim + self.heads, bias=m.proj_bias)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, m.conv, groups=self.conv_dim, padding=m.conv - 1, bias=m.conv_bias
        )
        self.dt_bias = nn.Parameter(torch.empty(self.heads))
        self.A_log = nn.Parameter(torch.empty(self.heads))
        self.D = nn.Parameter(torch.empty(self.heads))
        self.norm = GatedRMSNorm(self.inner, m.groups, cfg.norm_eps)
        self.out_proj = nn.Linear(self.inner, cfg.dim, bias=m.proj_bias)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """A_h = -h, D = 1, dt bias so that softplus(bias) spans [0.001, 0.1] log-uniformly."""
        with torch.no_grad():
            self.A_log.copy_(torch.arange(1, self.heads + 1, dtype=torch.float32, device=self.A_log.device).log())
            self.D.fill_(1.0)
            self.dt_bias.copy_(_inverse_softplus_dt(self.heads, self.dt_bias.device))

    def new_cache(self, batch: int, device: torch.device) -> MambaCache:
        """An empty decoding state for ``batch`` sequences."""
        shape = (self.heads, self.head_dim, self.state)
        return MambaCache(batch, self.conv_dim, self.conv1d.kernel_size[0], shape, device)

    def mix(self, x: torch.Tensor, cache: MambaCache | None, start: int, docs: Docs, split: RecurrentSplit | None):
        """See :meth:`~tessera.model.recurrent.RecurrentMixer.forward`."""
        document_ids = docs
        batch, length, _ = x.shape
        # Widths from the parameters: a tensor-parallel rank holds some heads and their B/C groups.
        heads, conv_dim = self.A_log.shape[0], self.conv1d.weight.shape[0]
        inner = heads * self.head_dim
        groups = (conv_dim - inner) // (2 * self.state)
        z, xbc, dt = self.in_proj(x).split([inner, conv_dim, heads], dim=-1)
        xbc = causal_conv(xbc.transpose(1, 2), self.conv1d, cache, start, document_ids, split).transpose(1, 2)
        xs, b, c = xbc.float().split([inner, groups * self.state, groups * self.state], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float())  # (B, T, H)
        dt = dt.clamp(min=self.dt_min) if self.dt_min else dt
        b, c = (t.view(batch, length, groups, self.state).repeat_interleave(heads // groups, dim=2) for t in (b, c))
        xs = xs.view(batch, length, heads, self.head_dim)
        a = -torch.exp(self.A_log.float())
        h0 = cache.ssm if cache is not None else None
        if split is not None:
            y = split_ssd_scan(xs * dt[..., None], dt * a, b, c, self.chunk, split, document_ids)
        else:
            y, h = ssd_scan(xs * dt[..., None], dt * a, b, c, h0, self.chunk, document_ids)
        if cache is not None:
            cache.ssm.copy_(h)
        y = y + xs * self.D.float()[:, None]
        return self.out_proj(self.norm(y.reshape(batch, length, inner), z).to(x.dtype))


def build_mamba(cfg: ModelConfig) -> nn.Module:
    """The mixer ``[model.mamba].version`` names."""
    return Mamba2Mixer(cfg) if cfg.mamba.version == 2 else MambaMixer(cfg)


def check_mamba(m: ModelConfig) -> None:
    """[model.mamba]: its version, widths and the Mamba-2 head split."""
    mamba = m.mamba
    require(mamba.version in (1, 2), f"model.mamba.version must be 1 or 2, got {mamba.version}")
    require_all("model.mamba", mamba, ("state", "conv", "expand", "head_dim", "groups", "chunk"), positive=True)
    require_all("model.mamba", mamba, ("dt_rank",), positive=False)
    require(mamba.version == 1 or not mamba.dt_norm, "model.mamba.dt_norm (Jamba) is a Mamba-1 option; set version = 1")
    require(
        mamba.dt_min >= 0 and (mamba.version == 2 or not mamba.dt_min),
        f"model.mamba.dt_min={mamba.dt_min} must be >= 0, and is a Mamba-2 option (set version = 2 or dt_min = 0)",
    )
    if mamba.version == 2:
        inner = mamba.expand * m.dim
        require(
            inner % mamba.head_dim == 0 and (inner // mamba.head_dim) % mamba.groups == 0,
            f"model.mamba: the inner width expand*dim={inner} must split into heads of head_dim={mamba.head_dim}, "
            f"and the heads into groups={mamba.groups}",
        )


# tp: channels and heads split by tessera/parallel/recurrent.py; cp: each rank scans its pieces from zero and the
# summaries combine over the ranks (split_scan, parallel/context.py).
MAMBA_UNSUPPORTED: dict[str, str] = {}
# FLOPs: no score products (PaLM's term); the projections are in 6 * N. Memory: measured by the planner.
MAMBA_TERMS = registry.Terms(flops=registry.zero, memory=registry.TRACED)


def _forward(module: nn.Module, h: torch.Tensor, ctx: object, cache: MambaCache | None, start: int) -> torch.Tensor:
    return module(h, cache, start, getattr(ctx, "document_ids", None), getattr(ctx, "split", None))


def _new_cache(module: nn.Module, batch: int, max_len: int, dtype: torch.dtype, device: torch.device) -> MambaCache:
    return module.new_cache(batch, device)


def _mamba_spec(name: str, version: int, mixer: type[nn.Module]) -> registry.MixerSpec:
    return registry.MixerSpec(
        name=name,
        feature="Mamba layers",
        keys=("model.layer_pattern", "model.mamba"),
        uses=lambda m: "M" in m.layer_pattern and (m.mamba.version == 2) == (version == 2),
        unsupported=MAMBA_UNSUPPORTED,
        checks=(check_mamba,),
        terms=MAMBA_TERMS,
        # Empty: no projection is a DTensor shard (HF's fused in_proj is laid out by role, not by head); every
        # parameter is sliced per rank by tessera/parallel/recurrent.py's MambaChannels.
        tp_plan={},
        letters={"M": "Mamba"},
        selects=lambda m: (m.mamba.version == 2) == (version == 2),
        attr="mamba",
        has_ffn=lambda cfg: cfg.mamba.ffn,
        recurrent=True,
        build=lambda cfg, layer_id: mixer(cfg),
        forward=_forward,
        new_cache=_new_cache,
    )


MAMBA = registry.register(_mamba_spec("mamba", 1, MambaMixer))
MAMBA2 = registry.register(_mamba_spec("mamba2", 2, Mamba2Mixer))
