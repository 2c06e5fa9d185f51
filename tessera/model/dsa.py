"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2): latent attention over the top-k keys a lightning indexer picks.

The **lightning indexer** scores every (query, key) pair cheaply: a few heads
(``[model.dsa].index_heads`` x ``index_head_dim``, queries from the latent query ``q_resid``, one key
per token, LayerNorm'd, both RoPE'd on their first ``rope_head_dim`` channels),
``I[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s]) / sqrt(D)`` with per-token head weights ``w``.
Each query then attends only to its ``topk`` best-scored keys (within the causal mask).

The sparse core never forms a (length x length) score matrix: for each chunk of queries the latents and
RoPE keys of its selected tokens are gathered, ``(chunk, topk, kv_rank + rope_head_dim)``, and attention
runs with ``kv_b_proj`` absorbed into the queries and the output (MLA's MQA form, as DeepSeek's kernel
does), so memory is O(length x topk); under autograd each chunk is recomputed in backward.

**Training**, as DeepSeek describes it: the indexer learns from a KL term between the main attention's
distribution (summed over heads, L1-normalized, detached) and softmax of its own scores, with its inputs
detached, so its gradient reaches only the indexer and the LM loss reaches only the main model. In the
``warmup`` stage attention is dense, the KL spans all causal keys and only the indexer trains
(:func:`freeze_for_indexer_warmup`); in the ``sparse`` stage attention uses the top-k and the KL spans
the selected keys. The KL term joins the loss through its gradient (:class:`AttachLoss`, Megatron's
auxiliary-loss scaler), so the trainer needs no change: ``indexer_loss_coef`` x the mean over queries
per layer, added per micro-batch.

Parameter names follow HF transformers' ``DeepseekV32Indexer`` (``indexer.wq_b``, ``wk``, ``k_norm``,
``weights_proj``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tessera import registry
from tessera.config import ModelConfig
from tessera.config.checks import require, require_all
from tessera.model.attention import AttnContext, _allowed, scaled_by_layer
from tessera.model import mla
from tessera.model.mla import LatentAttention, LatentCache
from tessera.model.position import apply_rope

# Query rows per chunk of the sparse core and of the indexer's top-k selection.
QUERY_CHUNK = 1024


class AttachLoss(torch.autograd.Function):
    """Identity on ``x``; in backward ``loss`` receives gradient 1, as if it were added to the final loss."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:  # noqa: D102
        ctx.loss_shape = loss.shape
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        return grad, torch.ones(ctx.loss_shape, dtype=grad.dtype, device=grad.device)


class IndexedLatentCache(LatentCache):
    """A :class:`LatentCache` plus the indexer's keys (B, T, index_head_dim)."""

    def __init__(self, batch: int, kv_rank: int, rope_dim: int, index_dim: int, max_len: int, dtype, device):
        super().__init__(batch, kv_rank, rope_dim, max_len, dtype, device)
        self.index_keys = torch.zeros(batch, max_len, index_dim, dtype=dtype, device=device)

    def update_index(self, keys: torch.Tensor, start: int) -> torch.Tensor:
        """Write the indexer keys of positions ``start..`` and return all up to there."""
        end = start + keys.shape[1]
        self.index_keys[:, start:end] = keys
        return self.index_keys[:, :end].to(keys.dtype)


class LightningIndexer(nn.Module):
    """DSA's lightning indexer: per-query scores over all keys, from which each query keeps its top-k."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        dsa = cfg.dsa
        self.n_heads, self.head_dim = dsa.index_heads, dsa.index_head_dim
        self.wq_b = nn.Linear(cfg.mla.q_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.dim, self.n_heads, bias=False)
        self.scale = self.head_dim**-0.5

    def keys(self, x: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        """(B, T, D) LayerNorm'd, RoPE'd keys of ``x`` (B, T, dim)."""
        return apply_rope(self.k_norm(self.wk(x))[:, None], ctx.cos, ctx.sin)[:, 0]

    def queries(self, x: torch.Tensor, q_resid: torch.Tensor, ctx: AttnContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, H, T, D) RoPE'd queries from the latent query and (B, T, H) per-token head weights (fp32)."""
        b, t, _ = q_resid.shape
        q = self.wq_b(q_resid).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        weights = self.weights_proj(x).float() * self.n_heads**-0.5
        return apply_rope(q, ctx.cos, ctx.sin), weights

    def scores(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Index scores: all keys (B, Tk, D) give (B, Tq, Tk); per-query keys (B, Tq, k, D) give (B, Tq, k)."""
        if keys.dim() == 3:
            s = F.relu(q.float() @ keys.float()[:, None].transpose(-1, -2) * self.scale)
            return torch.einsum("bth,bhts->bts", weights, s)
        s = F.relu(torch.einsum("bhtd,btkd->bhtk", q.float(), keys.float()) * self.scale)
        return torch.einsum("bth,bhtk->btk", weights, s)

    @torch.no_grad()
    def select(
        self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor, topk: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, Tq, topk) indices of each query's best allowed keys and whether each is allowed, computed a
        chunk of queries at a time (no (Tq, Tk) matrix for all queries at once)."""
        picks, valid = [], []
        for rows in _chunks(q.shape[2]):
            s = self.scores(q[:, :, rows], weights[:, rows], keys).masked_fill(~allowed[:, rows], float("-inf"))
            idx = s.topk(topk, dim=-1).indices
            picks.append(idx)
            valid.append(allowed[:, rows].expand(idx.shape[0], -1, -1).gather(-1, idx))
        return torch.cat(picks, 1), torch.cat(valid, 1)


def _chunks(length: int) -> list[slice]:
    return [slice(i, min(i + QUERY_CHUNK, length)) for i in range(0, length, QUERY_CHUNK)]


def gather_tokens(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """(B, Tk, C) per-token values at (B, Tq, k) indices -> (B, Tq, k, C) (``gather``: its backward is a
    scatter-add, much faster on CPU than advanced indexing's accumulating index_put)."""
    b, tq, k = idx.shape
    flat = idx.reshape(b, tq * k, 1).expand(-1, -1, x.shape[-1])
    return x.gather(1, flat).view(b, tq, k, x.shape[-1])


def sparse_latent_core(
    q_lat: torch.Tensor,
    q_rope: torch.Tensor,
    latent: torch.Tensor,
    k_rope: torch.Tensor,
    idx: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of (B, H, Tq, kv_rank) absorbed queries (and their RoPE parts) over each query's ``idx`` keys,
    in the latent: the (B, H, Tq, kv_rank) latent-space output and the (B, Tq, k) attention weights summed
    over heads in fp64 (detached; the indexer's KL target)."""
    lat, rope = gather_tokens(latent, idx), gather_tokens(k_rope, idx)
    scores = torch.einsum("bhtr,btkr->bhtk", q_lat, lat) + torch.einsum("bhtd,btkd->bhtk", q_rope, rope)
    probs = (scores.float() * scale).masked_fill(~valid[:, None], float("-inf")).softmax(-1).to(lat.dtype)
    # The head sum in fp64: split over tp ranks in any order, it rounds to the same fp32 target.
    return torch.einsum("bhtk,btkr->bhtr", probs, lat), probs.detach().sum(1, dtype=torch.float64)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


@dataclass(frozen=True)
class HeadGroup:
    """How this module's attention heads stand to the layer's: all of them here by default. Tensor parallelism
    (which splits the heads, not the replicated indexer) replaces it (``tessera.parallel.tensor_attention``)."""

    whole_input: Callable[[torch.Tensor], torch.Tensor] = _same  # the detached block input, whole sequence
    sum_heads: Callable[[torch.Tensor], torch.Tensor] = _same  # a detached sum over these heads -> over all heads
    local: Callable[[torch.Tensor], torch.Tensor] = _same  # a head-split weight -> the rows of these heads
    shared: Callable[[torch.Tensor], torch.Tensor] = _same  # a value all heads read: gradient summed over them


class SparseLatentAttention(LatentAttention):
    """Latent attention whose queries each attend to the top-k keys of a :class:`LightningIndexer`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.indexer = LightningIndexer(cfg)
        self.heads = HeadGroup()
        self.topk, self.stage, self.loss_coef = cfg.dsa.topk, cfg.dsa.stage, cfg.dsa.indexer_loss_coef
        self.last_indexer_loss: torch.Tensor | None = None  # the latest training forward's KL (detached)

    def forward(
        self, x: torch.Tensor, ctx: AttnContext, cache: IndexedLatentCache | None = None, start: int = 0
    ) -> torch.Tensor:
        """Attend from ``x`` (B, T, dim) to the top-k keys of each query (cached positions included)."""
        b, t, _ = x.shape
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(b, t, -1, self.nope + self.rope).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_rope = apply_rope(q_rope, ctx.cos, ctx.sin)
        k_rope = apply_rope(k_rope[:, None], ctx.cos, ctx.sin)[:, 0]
        # The indexer learns only from its KL term: its inputs are detached from the main model.
        ix = self.heads.whole_input(x.detach())
        index_keys = self.indexer.keys(ix, ctx)
        if cache is not None:
            latent, k_rope = cache.update(latent, k_rope, start)
            index_keys = cache.update_index(index_keys, start)
        queries = (q_nope, q_rope, *self.indexer.queries(ix, q_resid.detach(), ctx))
        if ctx.attend is None:
            allowed = _allowed_3d(ctx, t, latent.shape[1], x.device)
            out, loss = self._core(queries, latent, k_rope, index_keys, allowed)
        else:  # a split sequence: its attention gathers every rank's keys (packed) and builds the global mask
            out, loss = self._split_core(queries, latent, k_rope, index_keys, ctx)
        out = self.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        if loss is None:
            return out
        self.last_indexer_loss = loss.detach()
        return AttachLoss.apply(out, loss * self.loss_coef)

    def _core(self, queries, latent, k_rope, index_keys, allowed) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, H, Tq, v_head_dim) attention over the selected (or, in warm-up, all) keys and the indexer's KL
        (training only)."""
        q_nope, q_rope, iq, iw = queries
        learn = self.training and torch.is_grad_enabled()
        if self.stage == "warmup" or self.topk >= latent.shape[1]:
            out = self._dense(q_nope, q_rope, latent, k_rope, AttnContext(mask=allowed[:, None]))
            loss = self._dense_kl(q_nope, q_rope, latent, k_rope, allowed, iq, iw, index_keys) if learn else None
            return out, loss
        idx, valid = self.indexer.select(iq, iw, index_keys, allowed, self.topk)
        out, target = self._sparse(q_nope, q_rope, latent, k_rope, idx, valid)
        target = self.heads.sum_heads(target).float()
        loss = _kl(target, self.indexer.scores(iq, iw, gather_tokens(index_keys, idx)), valid) if learn else None
        return out, loss

    def _split_core(self, queries, latent, k_rope, index_keys, ctx: AttnContext):
        """:meth:`_core` under a sequence split (context parallelism, all-gather): the latents, RoPE keys and
        indexer keys travel as one (B, 1, T, C) "key" through the split's attention, whose mask spans every
        rank's keys, so each query's top-k is global over the sequence."""
        widths = [self.kv_rank, self.rope, index_keys.shape[-1]]
        packed = torch.cat([latent, k_rope, index_keys], dim=-1)[:, None]
        found: dict[str, torch.Tensor] = {}

        class Gathered:  # stands in for an attention layer: receives the gathered keys and the global mask
            scale = self.scale

            @staticmethod
            def attend(_q, keys: torch.Tensor, _v, gctx: AttnContext) -> torch.Tensor:
                found["keys"], found["mask"] = keys, gctx.mask
                return _q

        ctx.attend(Gathered, queries[0], packed, packed[..., :1], ctx)
        mask = found["mask"]
        allowed = (mask if mask.dtype == torch.bool else mask == 0)[:, 0]
        latent, k_rope, index_keys = found["keys"][:, 0].split(widths, dim=-1)
        return self._core(queries, latent, k_rope, index_keys, allowed)

    def _dense(self, q_nope, q_rope, latent, k_rope, ctx: AttnContext) -> torch.Tensor:
        """Dense latent attention (the parent's core), (B, H, Tq, v_head_dim)."""
        b, tk = latent.shape[:2]
        kv = self.kv_b_proj(latent).view(b, tk, -1, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope[:, None].expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        return self.attend(torch.cat([q_nope, q_rope], dim=-1), k, v, ctx)

    def _absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's key (H, nope, kv_rank) and value (H, v_head_dim, kv_rank) halves."""
        w = self.heads.local(self.kv_b_proj.weight).view(-1, self.nope + self.v_dim, self.kv_rank)
        return w[:, : self.nope], w[:, self.nope :]

    def _sparse(self, q_nope, q_rope, latent, k_rope, idx, valid) -> tuple[torch.Tensor, torch.Tensor]:
        """The sparse core a chunk of queries at a time, recomputed in backward: (B, H, Tq, v_head_dim)
        and the (B, Tq, k) head-summed attention weights."""
        w_uk, w_uv = self._absorbed()
        q_lat = torch.einsum("bhtn,hnr->bhtr", q_nope, w_uk)
        latent = self.heads.shared(latent)  # read here by these heads alone (not through kv_b_proj)
        outs, targets = [], []
        for rows in _chunks(q_lat.shape[2]):
            args = (q_lat[:, :, rows], q_rope[:, :, rows], latent, k_rope, idx[:, rows], valid[:, rows], self.scale)
            if torch.is_grad_enabled():
                o, p = checkpoint(sparse_latent_core, *args, use_reentrant=False)
            else:
                o, p = sparse_latent_core(*args)
            outs.append(o)
            targets.append(p)
        return torch.einsum("bhtr,hvr->bhtv", torch.cat(outs, 2), w_uv), torch.cat(targets, 1)

    @torch.no_grad()
    def _dense_weights(self, q_nope, q_rope, latent, k_rope, allowed) -> torch.Tensor:
        """(B, Tq, Tk) dense attention weights summed over heads (the warm-up's KL target)."""
        w_uk, _ = self._absorbed()
        q_lat = torch.einsum("bhtn,hnr->bhtr", q_nope, w_uk)
        scores = (q_lat @ latent[:, None].transpose(-1, -2) + q_rope @ k_rope[:, None].transpose(-1, -2)).float()
        weights = (scores * self.scale).masked_fill(~allowed[:, None], float("-inf")).softmax(-1)
        return self.heads.sum_heads(weights.sum(1, dtype=torch.float64)).float()

    def _dense_kl(self, q_nope, q_rope, latent, k_rope, allowed, iq, iw, index_keys) -> torch.Tensor:
        target = self._dense_weights(q_nope, q_rope, latent, k_rope, allowed)
        return _kl(target, self.indexer.scores(iq, iw, index_keys), allowed.expand_as(target))

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device) -> IndexedLatentCache:
        """An empty latent + indexer-key cache for ``max_len`` positions."""
        return IndexedLatentCache(batch, self.kv_rank, self.rope, self.indexer.head_dim, max_len, dtype, device)


def _allowed_3d(ctx: AttnContext, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """The context's mask as (B|1, Tq, Tk) booleans (all True without one)."""
    allowed = _allowed(ctx, q_len, kv_len, device)
    if allowed is None:
        return torch.ones(1, q_len, kv_len, dtype=torch.bool, device=device)
    return allowed[None] if allowed.dim() == 2 else allowed[:, 0]


def _kl(target: torch.Tensor, scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean over queries of KL(target / sum(target) || softmax(scores)) over the ``valid`` keys."""
    p = target / target.sum(-1, keepdim=True).clamp_min(1e-12)
    log_q = scores.masked_fill(~valid, float("-inf")).log_softmax(-1)
    terms = torch.where(valid & (p > 0), p * (p.clamp_min(1e-30).log() - log_q), torch.zeros_like(p))
    return terms.sum(-1).mean()


def freeze_for_indexer_warmup(model: nn.Module) -> None:
    """The warm-up stage trains only the indexers: every other parameter stops requiring gradients."""
    for name, param in model.named_parameters():
        param.requires_grad_(".indexer." in f".{name}")


def check_dsa(m: ModelConfig) -> None:
    """[model.dsa]: the indexer reads the latent query and rotates its first rope_head_dim channels."""
    dsa = m.dsa
    require(dsa.topk > 0, f"model.dsa.topk must be >= 0 (0 = dense latent attention), got {dsa.topk}")
    require(
        m.mla.kv_rank > 0 and m.mla.q_rank > 0,
        "model.dsa (sparse attention) runs on latent attention with a query bottleneck: set model.mla.kv_rank and "
        "model.mla.q_rank",
    )
    require_all("model.dsa", dsa, ("index_heads", "index_head_dim"), positive=True)
    require(
        dsa.index_head_dim >= m.mla.rope_head_dim,
        f"model.dsa.index_head_dim={dsa.index_head_dim} must be >= model.mla.rope_head_dim={m.mla.rope_head_dim} "
        "(the indexer rotates that many channels)",
    )
    require(dsa.indexer_loss_coef >= 0, f"model.dsa.indexer_loss_coef must be >= 0, got {dsa.indexer_loss_coef}")


def _sparse_flops(cfg: ModelConfig, seq_len: int) -> float:
    """Per token: the score and value products over ``topk`` keys (not the causal average), and the indexer's
    scores over every key (one head-dim product per indexer head, forward and backward of its KL)."""
    keys = min(cfg.dsa.topk, seq_len)
    qk, heads = cfg.mla.nope_head_dim + cfg.mla.rope_head_dim, cfg.n_heads
    attention = 6 * heads * keys * (qk + cfg.mla.v_head_dim)
    return attention + 6 * cfg.dsa.index_heads * cfg.dsa.index_head_dim * seq_len / 2


def _build(cfg: ModelConfig, layer_id: int) -> SparseLatentAttention:
    return scaled_by_layer(SparseLatentAttention(cfg), cfg, layer_id)


MIXER = registry.register(
    registry.MixerSpec(
        name="sparse_latent",
        feature="DeepSeek sparse attention",
        keys=("model.dsa", "model.mla"),
        uses=lambda m: bool(m.mla.kv_rank and m.dsa.topk),
        unsupported={},
        # latent attention's heads split over tp, the indexer replicated (parallel/tensor_attention.py)
        tp_plan=mla.MIXER.tp_plan,
        checks=(check_dsa,),
        terms=registry.Terms(flops=_sparse_flops, memory=registry.TRACED),
        letters={"A": "attention", "G": "global attention"},
        selects=lambda m: bool(m.mla.kv_rank and m.dsa.topk),
        attr="attention",
        build=_build,
        forward=lambda module, h, ctx, cache, start: module(h, ctx, cache, start),
        new_cache=lambda module, batch, max_len, dtype, device: module.new_cache(batch, max_len, dtype, device),
    )
)

RING = registry.option(
    name="dsa_ring",
    feature="DeepSeek sparse attention with cp_method=ring",
    keys=("model.dsa.topk", "parallel.cp_method"),
    scope="job",
    uses=lambda job: bool(job.model.dsa.topk) and job.parallel.cp_method == "ring",
    unsupported={
        "cp": "each query's top-k ranges over every rank's keys, which the ring never holds at once; use "
        "parallel.cp_method=allgather",
    },
    checks=(),
)
