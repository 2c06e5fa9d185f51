"""Training objectives as collators on the packed token stream: causal LM, masked LM, T5 span corruption.

Each turns a (B, seq_len + 1) window batch into model arguments and labels (-100 = no loss).
Masked LM and span corruption need ids outside the tokenizer's vocabulary: they use the
``model.sentinel_tokens`` ids reserved at the top of ``model.vocab_size`` ([MASK] is the top id;
T5 sentinel k is ``vocab_size - 1 - k``). Their randomness is drawn per sequence, from the seed
and that sequence's tokens only, so a resumed run and every evaluation see the same masks, and a
batch split over data-parallel ranks is masked exactly as it is on one process.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from tessera.config import ModelConfig, resolved_objective

IGNORE = -100


def span_count(length: int, density: float, mean_span: float) -> int:
    """How many noise spans T5 span corruption cuts into ``length`` tokens (one sentinel each)."""
    noise = min(max(round(length * density), 1), length - 1)
    return max(round(noise / mean_span), 1)


def span_lengths(length: int, density: float, mean_span: float) -> tuple[int, int]:
    """(encoder, decoder) lengths of T5 span corruption of ``length`` tokens: the kept tokens plus one
    sentinel per span, and one sentinel per span plus the noise tokens."""
    noise = min(max(round(length * density), 1), length - 1)
    spans = span_count(length, density, mean_span)
    return length - noise + spans, noise + spans


class _Batch(Protocol):
    tokens: torch.Tensor
    loss_mask: torch.Tensor | None

    def model_kwargs(self) -> dict[str, torch.Tensor]: ...


def causal_lm(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token labels from (batch, seq_len + 1) tokens."""
    return batch[:, :-1], batch[:, 1:]


def masked_lm(
    tokens: torch.Tensor, mask_id: int, n_real: int, prob: float, generators: list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT masking: ``prob`` of positions get a label; of those 80% become [MASK], 10% a random
    real token (id < ``n_real``), 10% stay; row ``i`` draws from ``generators[i]``. Returns (inputs, labels)."""
    length = tokens.shape[1]
    draws = [
        (
            torch.rand(length, generator=g),
            torch.rand(length, generator=g),
            torch.randint(0, n_real, (length,), generator=g),
        )
        for g in generators
    ]
    chosen, action, random_tokens = (torch.stack(parts).to(tokens.device) for parts in zip(*draws))
    chosen = chosen < prob
    inputs = torch.where(chosen & (action < 0.8), torch.full_like(tokens, mask_id), tokens)
    inputs = torch.where(chosen & (action >= 0.8) & (action < 0.9), random_tokens, inputs)
    labels = torch.where(chosen, tokens, torch.full_like(tokens, IGNORE))
    return inputs, labels


def _segments(total: int, parts: int, generator: torch.Generator) -> list[int]:
    """``total`` split into ``parts`` positive lengths at uniformly random cut points."""
    cuts = sorted((torch.randperm(total - 1, generator=generator)[: parts - 1] + 1).tolist())
    bounds = [0, *cuts, total]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def span_corruption(
    tokens: torch.Tensor,
    vocab_size: int,
    density: float,
    mean_span: float,
    generators: list[torch.Generator],
    start_id: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """T5 span corruption of each row of ``tokens`` (B, L): noise spans are cut out of the encoder
    input, each replaced by one sentinel; the target lists every sentinel followed by its span; row
    ``i`` draws from ``generators[i]``. Returns (encoder inputs, decoder inputs = target shifted right
    after ``start_id``, labels)."""
    length = tokens.shape[1]
    n_noise = min(max(round(length * density), 1), length - 1)
    n_spans = span_count(length, density, mean_span)
    enc, tgt = [], []
    for row, generator in zip(tokens.tolist(), generators):
        noise, keep = _segments(n_noise, n_spans, generator), _segments(length - n_noise, n_spans, generator)
        src, target, pos = [], [], 0
        for k, (kept, noisy) in enumerate(zip(keep, noise)):
            sentinel = vocab_size - 1 - k
            src += row[pos : pos + kept] + [sentinel]
            target += [sentinel] + row[pos + kept : pos + kept + noisy]
            pos += kept + noisy
        enc.append(src)
        tgt.append(target)
    enc_t = torch.tensor(enc, dtype=tokens.dtype, device=tokens.device)
    labels = torch.tensor(tgt, dtype=tokens.dtype, device=tokens.device)
    dec = torch.cat([torch.full_like(labels[:, :1], start_id), labels[:, :-1]], dim=1)
    return enc_t, dec, labels


def row_generators(seed: int, tokens: torch.Tensor) -> list[torch.Generator]:
    """One generator per row of ``tokens`` (B, L), seeded by ``seed`` and that row's tokens only."""
    weights = torch.arange(1, min(64, tokens.shape[1]) + 1, device=tokens.device)
    firsts = (tokens[:, :64] * weights).sum(1).tolist()
    sums = tokens.sum(1).tolist()
    return [
        torch.Generator().manual_seed((seed * 1_000_003 + a * 7919 + b) % (2**63 - 1)) for a, b in zip(firsts, sums)
    ]


class Objective:
    """The recipe's objective as a collator: ``objective(batch) -> (args, kwargs, labels, loss_mask)``."""

    def __init__(self, cfg: ModelConfig, seed: int) -> None:
        self.name, self.cfg, self.seed = resolved_objective(cfg), cfg, seed

    def __call__(
        self, batch: _Batch
    ) -> tuple[tuple[torch.Tensor, ...], dict[str, Any], torch.Tensor, torch.Tensor | None]:
        """Model positional args, model keyword args, labels (B, T), and the loss mask (or None)."""
        cfg, tokens = self.cfg, batch.tokens
        if self.name == "causal_lm":
            inputs, labels = causal_lm(tokens)
            return (inputs,), batch.model_kwargs(), labels, batch.loss_mask
        gen = row_generators(self.seed, tokens)
        if self.name == "masked_lm":
            inputs, labels = masked_lm(
                tokens[:, :-1], cfg.vocab_size - 1, cfg.vocab_size - cfg.sentinel_tokens, cfg.mask_prob, gen
            )
            return (inputs,), batch.model_kwargs(), labels, labels != IGNORE
        enc, dec, labels = span_corruption(tokens, cfg.vocab_size, cfg.mask_prob, cfg.mean_span_length, gen)
        return (enc, dec), {}, labels, None
