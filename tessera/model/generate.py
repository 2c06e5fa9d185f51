"""Autoregressive decoding with a KV cache: greedy, temperature, top-k and top-p sampling; batches of prompts
of different lengths (left padding); caches of any kind (:mod:`tessera.model.cache`), preallocated and reusable.

Speculative decoding (a draft model or the model's own multi-token-prediction modules proposing
tokens that the model verifies in one forward) is in :mod:`tessera.model.speculative`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tessera.model.cache import cache_bytes, cache_footprint, new_caches
from tessera.model.transformer import Decoder, EncoderDecoder

__all__ = [
    "cache_bytes",
    "cache_footprint",
    "cached_nll",
    "filtered_logits",
    "generate",
    "generate_seq2seq",
    "new_caches",
    "pad_left",
    "sample_next",
]


def filtered_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """``logits`` (..., vocab) in float32 divided by ``temperature`` (> 0), with the tokens outside the top ``k``
    and outside the nucleus of mass ``top_p`` set to -inf: softmax of this is the sampling distribution."""
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass before it already reaches top_p (the top token always stays).
        drop = probs.cumsum(dim=-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pick one token per row of ``logits`` (batch, vocab); temperature 0 means greedy."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = filtered_logits(logits, temperature, top_k, top_p).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def pad_left(prompts: Sequence[Sequence[int] | torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of different lengths as one (B, longest) batch padded on the left, and each row's padding (B,)."""
    rows = [torch.as_tensor(p, dtype=torch.long).flatten() for p in prompts]
    if not rows or any(r.numel() == 0 for r in rows):
        raise ValueError("every prompt needs at least one token")
    longest = max(r.numel() for r in rows)
    tokens = torch.full((len(rows), longest), pad_id, dtype=torch.long, device=rows[0].device)
    for i, r in enumerate(rows):
        tokens[i, longest - r.numel() :] = r
    return tokens, torch.tensor([longest - r.numel() for r in rows], device=tokens.device)


def _prompt_batch(prompt: torch.Tensor | Sequence) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A (B, L) prompt as is, or ragged prompts left-padded (with each row's padding)."""
    if isinstance(prompt, torch.Tensor) and prompt.dim() == 2:
        return prompt, None
    tokens, pad = pad_left(prompt)
    return tokens, pad if bool(pad.any()) else None


def _caches_for(model: Decoder, batch: int, total: int, kv_cache: str, caches: list | None) -> list:
    """Fresh caches of ``kv_cache`` kind, or the caller's preallocated ones (reused: overwritten from 0)."""
    if caches is None:
        return new_caches(model, batch, total, kv_cache)
    # Positional stores (KV, latent) must cover every position; a ring buffer (``window``) needs only its window.
    held = [getattr(c, "k", getattr(c, "latent", None)) for c in caches if not hasattr(c, "window")]
    for store in held:
        if store is not None and (store.shape[0] != batch or store.shape[-2] < total):
            raise ValueError(
                f"the given caches hold {store.shape[0]} rows of {store.shape[-2]} positions; this call needs exactly "
                f"{batch} rows of at least {total}"
            )
    return caches


@torch.no_grad()
def generate(
    model: Decoder,
    prompt: torch.Tensor | Sequence[Sequence[int] | torch.Tensor],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
    *,
    kv_cache: str = "auto",
    caches: list | None = None,
) -> torch.Tensor:
    """Continue ``prompt`` by up to ``max_new_tokens``; returns only the new tokens (B, n).

    ``prompt`` is a (B, L) tensor, or a list of prompts of different lengths (left-padded into one
    batch: padding is masked out and positions count from each row's first token). ``kv_cache``
    picks the cache storage (:data:`tessera.model.cache.CACHE_KINDS`: "auto", "fp32", "bf16",
    "fp16", "int8"); ``caches`` reuses preallocated ones (from :func:`tessera.model.cache.new_caches`,
    large enough for the batch and prompt + new tokens) instead of allocating. Stops early when every
    row has produced ``eos_id`` (rows that finished first repeat it) or at the model's max_seq_len.
    """
    was_training = model.training
    model.eval()
    try:
        tokens, left_pad = _prompt_batch(prompt)
        batch, length = tokens.shape
        total = min(length + max_new_tokens, model.cfg.max_seq_len)
        caches = _caches_for(model, batch, total, kv_cache, caches)
        logits = model(tokens, caches, start=0, left_pad=left_pad)[:, -1]
        out: list[torch.Tensor] = []
        done = torch.zeros(batch, dtype=torch.bool, device=tokens.device)
        for pos in range(length, total):
            token = sample_next(logits, temperature, top_k, top_p, generator)
            if eos_id is not None:
                token = token.masked_fill(done, eos_id)
                done |= token == eos_id
            out.append(token)
            if eos_id is not None and bool(done.all()):
                break
            if pos + 1 < total:
                logits = model(token[:, None], caches, start=pos, left_pad=left_pad)[:, -1]
        return torch.stack(out, dim=1) if out else tokens.new_zeros((batch, 0))
    finally:
        model.train(was_training)


@torch.no_grad()
def cached_nll(model: Decoder, sequences: torch.Tensor, kv_cache: str = "auto") -> float:
    """Mean next-token negative log-likelihood of ``sequences`` (B, T) read through a decoding cache one token
    at a time (teacher forcing): the numbers generation sees, for comparing cache kinds (exp = perplexity)."""
    was_training = model.training
    model.eval()
    try:
        batch, length = sequences.shape
        caches = new_caches(model, batch, length, kv_cache)
        total = torch.zeros((), dtype=torch.float64)
        for pos in range(length - 1):
            logits = model(sequences[:, pos : pos + 1], caches, start=pos)[:, -1].float()
            total += F.cross_entropy(logits, sequences[:, pos + 1], reduction="sum").double().cpu()
        return float(total) / (batch * (length - 1))
    finally:
        model.train(was_training)


@torch.no_grad()
def generate_seq2seq(
    model: EncoderDecoder, input_ids: torch.Tensor, max_new_tokens: int, start_id: int = 0, eos_id: int | None = None
) -> torch.Tensor:
    """Greedy decoding of an encoder-decoder model from ``start_id``; returns the new tokens (B, n)."""
    was_training = model.training
    model.eval()
    try:
        batch = input_ids.shape[0]
        memory = model.encode(input_ids)
        caches = model.new_caches(batch, max_new_tokens)
        token = torch.full((batch,), start_id, dtype=torch.long, device=input_ids.device)
        out: list[torch.Tensor] = []
        done = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
        for pos in range(max_new_tokens):
            token = model.decode(token[:, None], memory, caches, start=pos)[:, -1].argmax(dim=-1)
            out.append(token)
            if eos_id is not None:
                done |= token == eos_id
                if bool(done.all()):
                    break
        return torch.stack(out, dim=1) if out else input_ids.new_zeros((batch, 0))
    finally:
        model.train(was_training)
