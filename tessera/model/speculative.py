"""Speculative decoding: a cheap draft proposes ``k`` tokens, the model verifies them in one forward.

Each round the draft proposes tokens ``d_1 .. d_k`` (with its distributions ``q_i``); the target
reads the last accepted token and the drafts at once and gives its distributions ``p_1 .. p_k+1``.
Greedy: drafts are accepted while they equal the target's argmax, and the target's own token
follows, so the output is the target's greedy output token for token. Sampling (Leviathan et
al. 2023; Chen et al. 2023): ``d_i`` is accepted with probability ``min(1, p_i(d_i) / q_i(d_i))``;
the first rejected one is replaced by a sample of ``norm(max(0, p_i - q_i))``, and when all are
accepted a bonus token comes from ``p_k+1``: every emitted token is distributed exactly as the
target alone would sample it (with the same temperature, top-k and top-p).

Two drafts: :class:`ModelDraft`, a smaller decoder with the same vocabulary and its own cache, and
:class:`MTPDraft`, the target's own multi-token-prediction modules (``model.mtp_depth``), which
read the target's hidden states (self-speculative decoding). Rejected positions need no undo: the
caches are indexed by position and the next round overwrites them. Recurrent (Mamba) states
cannot be rewound, so models with Mamba layers are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tessera import registry
from tessera.model.cache import layer_caches, new_caches
from tessera.model.generate import filtered_logits
from tessera.model.transformer import Decoder


@dataclass
class Sampler:
    """How tokens are picked: greedy at temperature 0, else from the filtered distribution."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    generator: torch.Generator | None = None

    @property
    def greedy(self) -> bool:
        """Whether tokens are the argmax."""
        return self.temperature <= 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The sampling distribution (..., vocab) of ``logits`` (float32)."""
        return filtered_logits(logits, self.temperature, self.top_k, self.top_p).softmax(dim=-1)

    def pick(self, probs_or_logits: torch.Tensor) -> torch.Tensor:
        """One token per row: the argmax when greedy (of logits), else a sample (of probabilities)."""
        if self.greedy:
            return probs_or_logits.argmax(dim=-1)
        return torch.multinomial(probs_or_logits, 1, generator=self.generator).squeeze(-1)

    def uniform(self, device: torch.device) -> float:
        """One U(0, 1) draw from the sampler's generator."""
        return float(torch.rand(1, generator=self.generator, device=device))


@dataclass
class SpeculativeStats:
    """Counts of one speculative generation."""

    rounds: int = 0  # target forwards after the prompt
    proposed: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_round(self) -> float:
        """Tokens emitted per target forward (accepted drafts + the target's own)."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0


def accept_drafts(
    p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor, sampler: Sampler
) -> tuple[int, torch.Tensor]:
    """(how many of ``drafts`` (k,) are accepted, the token that follows them) from the target's ``p`` (k+1, V)
    (logits when greedy, else probabilities) and the draft's probabilities ``q`` (k, V) (None when greedy)."""
    k = drafts.shape[0]
    if sampler.greedy:
        target = p.argmax(dim=-1)
        agree = (target[:k] == drafts).long().cumprod(0)
        n = int(agree.sum())
        return n, target[n]
    for i in range(k):
        d = int(drafts[i])
        if sampler.uniform(p.device) * float(q[i, d]) < float(p[i, d]):
            continue
        residual = (p[i] - q[i]).clamp_min(0)
        if float(residual.sum()) <= 0:  # p == q up to rounding: rejection had probability 0
            residual = p[i]
        return i, sampler.pick((residual / residual.sum())[None])[0]
    return k, sampler.pick(p[k][None])[0]


class Draft(Protocol):
    """What proposes tokens to the target."""

    def start(self, total: int, kv_cache: str) -> None:
        """Allocate for a sequence of up to ``total`` positions."""
        ...

    def observe(self, hidden: torch.Tensor, start: int) -> None:
        """The target's final hidden states (1, T, dim) of positions ``start ..`` (kept where accepted)."""
        ...

    def propose(self, seq: torch.Tensor, k: int, sampler: Sampler) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``k`` tokens (k,) to follow ``seq`` (1, n), and their distributions (k, V) (None when greedy)."""
        ...

    def accepted(self, n: int, count: int, k: int) -> None:
        """``count`` of the ``k`` tokens proposed after ``seq`` of length ``n`` were accepted."""
        ...


def _pick_with_probs(logits: torch.Tensor, sampler: Sampler) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(token (1,), its distribution (1, V) or None when greedy) of logits (1, V)."""
    if sampler.greedy:
        return sampler.pick(logits), None
    probs = sampler.probs(logits)
    return sampler.pick(probs), probs


def _stack(tokens: list[torch.Tensor], probs: list[torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor | None]:
    return torch.cat(tokens), None if probs[0] is None else torch.cat(probs)


class ModelDraft:
    """A separate (smaller) decoder over the same vocabulary, with its own KV cache."""

    def __init__(self, model: Decoder) -> None:
        _check_rewindable(model, "the draft")
        self.model, self.caches, self.fed = model.eval(), [], 0

    def start(self, total: int, kv_cache: str) -> None:
        """A fresh cache for ``total`` positions."""
        self.caches, self.fed = new_caches(self.model, 1, total, kv_cache), 0

    def observe(self, hidden: torch.Tensor, start: int) -> None:
        """The draft reads tokens, not the target's states."""

    def propose(self, seq: torch.Tensor, k: int, sampler: Sampler) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed what the draft has not read yet, then ``k`` tokens one at a time."""
        n = seq.shape[1]
        logits = self.model(seq[:, self.fed :], self.caches, start=self.fed)[:, -1]
        tokens, probs = [], []
        for i in range(k):
            token, dist = _pick_with_probs(logits, sampler)
            tokens.append(token)
            probs.append(dist)
            if i < k - 1:
                logits = self.model(token[:, None], self.caches, start=n + i)[:, -1]
        self.fed = n
        return _stack(tokens, probs)

    def accepted(self, n: int, count: int, k: int) -> None:
        """The cache holds the drafts it read (all but the last) up to the first rejected one."""
        self.fed = n + min(count, k - 1)


class MTPDraft:
    """The target's own multi-token-prediction modules: depth ``j`` proposes the ``j``-th token ahead.

    Module ``j`` at position ``i`` reads the state of depth ``j - 1`` (the target's for ``j = 1``) and
    the token ``i + j``; each keeps a cache over positions. A round runs every depth over the
    positions since ``self.ready`` (those whose inputs changed) up to the last one with a known target
    state; the last position's outputs are the proposals.
    """

    def __init__(self, model: Decoder) -> None:
        if model.mtp is None:
            raise ValueError("--draft mtp needs a model trained with model.mtp_depth > 0; this one has none")
        _check_rewindable(model, "the model")
        self.model, self.modules = model, list(model.mtp.values())
        self.hidden = torch.empty(0)
        self.caches: list = []
        self.ready = 0

    def start(self, total: int, kv_cache: str) -> None:
        """State buffer and per-depth caches for ``total`` positions."""
        weight = self.model.output.weight
        self.hidden = torch.zeros(1, total, self.model.cfg.dim, dtype=weight.dtype, device=weight.device)
        self.caches = layer_caches([m.block for m in self.modules], 1, total, kv_cache, weight)
        self.ready = 0

    def observe(self, hidden: torch.Tensor, start: int) -> None:
        """Keep the target's states of positions ``start ..``."""
        self.hidden[:, start : start + hidden.shape[1]] = hidden

    def propose(self, seq: torch.Tensor, k: int, sampler: Sampler) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run depths 1..k over positions ``ready .. n-2`` (token ``n-1`` has no target state yet)."""
        if k > len(self.modules):
            raise ValueError(f"--draft mtp proposes at most model.mtp_depth={len(self.modules)} tokens, asked for {k}")
        n, first = seq.shape[1], self.ready
        length = n - 1 - first
        ctx = self.model.context(1, length, first, None, None, seq.device)
        state, ahead = self.hidden[:, first : n - 1], seq
        tokens, probs = [], []
        for depth, module in enumerate(self.modules[:k], 1):
            embedded = self.model.tok_embeddings(ahead[:, first + depth : n - 1 + depth])
            state = module(state, embedded, ctx, self.caches[depth - 1], first)
            token, dist = _pick_with_probs(self.model.output(module.norm(state[:, -1])), sampler)
            tokens.append(token)
            probs.append(dist)
            ahead = torch.cat([ahead, token[:, None]], dim=1)
        # Position i at depth j read token i + j: those up to n - 1 (known) stay valid for all k depths.
        self.ready = max(0, n - k)
        return _stack(tokens, probs)

    def accepted(self, n: int, count: int, k: int) -> None:
        """Nothing to rewind: the next round recomputes from ``ready``."""


def _check_rewindable(model: Decoder, what: str) -> None:
    recurrent = registry.recurrent_layers(model.layers.values())
    if recurrent:
        raise ValueError(f"speculative decoding rewinds caches; {what} has {recurrent}, whose state cannot rewind")


def _forward(model: Decoder, tokens: torch.Tensor, caches: list, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, final hidden states) of ``tokens`` at ``start``."""
    hidden = model.hidden_states(model.tok_embeddings(tokens), caches, start)
    return model.output(hidden), hidden


@torch.no_grad()
def speculative_generate(
    model: Decoder,
    draft: Draft,
    prompt: torch.Tensor,
    max_new_tokens: int,
    draft_tokens: int = 4,
    sampler: Sampler | None = None,
    eos_id: int | None = None,
    kv_cache: str = "auto",
) -> tuple[torch.Tensor, SpeculativeStats]:
    """Continue ``prompt`` (1, L) by up to ``max_new_tokens`` with ``draft`` proposing ``draft_tokens`` per round;
    returns the new tokens (1, n) and the round statistics. Greedy output equals :func:`generate`'s."""
    if prompt.dim() != 2 or prompt.shape[0] != 1:
        raise ValueError(f"speculative decoding takes one prompt (1, L); got shape {tuple(prompt.shape)}")
    if draft_tokens < 1:
        raise ValueError(f"draft_tokens must be >= 1, got {draft_tokens}")
    _check_rewindable(model, "the model")
    sampler = sampler or Sampler()
    model.eval()
    length = prompt.shape[1]
    total = min(length + max_new_tokens, model.cfg.max_seq_len)
    caches = new_caches(model, 1, total, kv_cache)
    draft.start(total, kv_cache)
    logits, hidden = _forward(model, prompt, caches, 0)
    draft.observe(hidden, 0)
    first, _ = _pick_with_probs(logits[:, -1], sampler)
    seq, stats = torch.cat([prompt, first[:, None]], dim=1), SpeculativeStats()
    while seq.shape[1] < total and not _ended(seq[0, length:], eos_id):
        seq = _round(model, draft, seq, min(draft_tokens, total - seq.shape[1]), sampler, caches, stats)
    out = seq[:, length : length + max_new_tokens]
    return _cut_at_eos(out, eos_id), stats


def _round(
    model: Decoder, draft: Draft, seq: torch.Tensor, k: int, sampler: Sampler, caches: list, stats: SpeculativeStats
) -> torch.Tensor:
    """One propose-verify round: ``seq`` extended by the accepted drafts and the target's token."""
    n = seq.shape[1]
    drafts, q = draft.propose(seq, k, sampler)
    logits, hidden = _forward(model, torch.cat([seq[:, -1], drafts])[None], caches, n - 1)
    p = logits[0] if sampler.greedy else sampler.probs(logits[0])
    count, token = accept_drafts(p, q, drafts, sampler)
    draft.observe(hidden[:, : count + 1], n - 1)
    draft.accepted(n, count, k)
    stats.rounds, stats.proposed, stats.accepted = stats.rounds + 1, stats.proposed + k, stats.accepted + count
    return torch.cat([seq, drafts[None, :count], token.view(1, 1)], dim=1)


def _ended(new: torch.Tensor, eos_id: int | None) -> bool:
    return eos_id is not None and bool((new == eos_id).any())


def _cut_at_eos(out: torch.Tensor, eos_id: int | None) -> torch.Tensor:
    """The tokens up to and including the first ``eos_id``."""
    if eos_id is None:
        return out
    hits = (out[0] == eos_id).nonzero()
    return out[:, : int(hits[0]) + 1] if hits.numel() else out
