"""Training objectives as collators on the packed token stream: causal LM, masked LM, T5 span corruption.

Each turns a (B, seq_len + 1) window batch into model arguments and labels (-100 = no loss).
Masked LM and span corruption need ids outside the tokenizer's vocabulary: they use the
``model.sentinel_tokens`` ids reserved at the top of ``model.vocab_size`` ([MASK] is the top id;
T5 sentinel k is ``vocab_size - 1 - k``). Their randomness is a pure function of the seed and
the batch's tokens, so a resumed run and every evaluation see the same masks.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from tessera.config import ModelConfig, resolved_objective, span_count

IGNORE = -100


class _Batch(Protocol):
    tokens: torch.Tensor
    loss_mask: torch.Tensor | None

    def model_kwargs(self) -> dict[str, torch.Tensor]: ...


def causal_lm(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token labels from (batch, seq_len + 1) tokens."""
    return batch[:, :-1], batch[:, 1:]


def masked_lm(
    tokens: torch.Tensor, mask_id: int, n_real: int, prob: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT masking: ``prob`` of positions get a label; of those 80% become [MASK], 10% a random
    real token (id < ``n_real``), 10% stay. Returns (inputs, labels)."""
    shape = tokens.shape
    chosen = torch.rand(shape, generator=generator) < prob
    action = torch.rand(shape, generator=generator)
    random_tokens = torch.randint(0, n_real, shape, generator=generator)
    chosen, action, random_tokens = chosen.to(tokens.device), action.to(tokens.device), random_tokens.to(tokens.device)
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
    generator: torch.Generator,
    start_id: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """T5 span corruption of each row of ``tokens`` (B, L): noise spans are cut out of the encoder
    input, each replaced by one sentinel; the target lists every sentinel followed by its span.
    Returns (encoder inputs, decoder inputs = target shifted right after ``start_id``, labels)."""
    length = tokens.shape[1]
    n_noise = min(max(round(length * density), 1), length - 1)
    n_spans = span_count(length, density, mean_span)
    enc, tgt = [], []
    for row in tokens.tolist():
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


def _batch_seed(seed: int, tokens: torch.Tensor) -> int:
    """A seed that depends only on ``seed`` and the batch's tokens."""
    weights = torch.arange(1, tokens.shape[1] + 1, device=tokens.device)
    return (seed * 1_000_003 + int((tokens[:, :64] * weights[:64]).sum()) * 7919 + int(tokens.sum())) % (2**63 - 1)


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
        gen = torch.Generator().manual_seed(_batch_seed(self.seed, tokens))
        if self.name == "masked_lm":
            inputs, labels = masked_lm(
                tokens[:, :-1], cfg.vocab_size - 1, cfg.vocab_size - cfg.sentinel_tokens, cfg.mask_prob, gen
            )
            return (inputs,), batch.model_kwargs(), labels, labels != IGNORE
        enc, dec, labels = span_corruption(tokens, cfg.vocab_size, cfg.mask_prob, cfg.mean_span_length, gen)
        return (enc, dec), {}, labels, None
