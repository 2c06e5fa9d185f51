"""Autoregressive decoding with a KV cache: greedy, temperature, top-k and top-p sampling."""

from __future__ import annotations

import torch

from tessera.model.transformer import Decoder, EncoderDecoder


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
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def cache_bytes(caches: list) -> int:
    """Memory held by decoding caches (every tensor they keep)."""
    return sum(t.numel() * t.element_size() for c in caches for t in vars(c).values() if isinstance(t, torch.Tensor))


def cache_footprint(model: Decoder, dtype: torch.dtype | None = None) -> tuple[int, int]:
    """(bytes per token of context, fixed bytes) of one sequence's decoding caches: KV caches grow with the
    context (latent attention's far less), Mamba states do not."""
    one, two = cache_bytes(model.new_caches(1, 1, dtype)), cache_bytes(model.new_caches(1, 2, dtype))
    return two - one, 2 * one - two


@torch.no_grad()
def generate(
    model: Decoder,
    prompt: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Continue ``prompt`` (batch, len) by up to ``max_new_tokens``; returns only the new tokens.

    Stops early when every row has produced ``eos_id`` or the model's max_seq_len is reached.
    """
    was_training = model.training
    model.eval()
    try:
        batch, length = prompt.shape
        total = min(length + max_new_tokens, model.cfg.max_seq_len)
        caches = model.new_caches(batch, total)
        logits = model(prompt, caches, start=0)[:, -1]
        out: list[torch.Tensor] = []
        done = torch.zeros(batch, dtype=torch.bool, device=prompt.device)
        for pos in range(length, total):
            token = sample_next(logits, temperature, top_k, top_p, generator)
            out.append(token)
            if eos_id is not None:
                done |= token == eos_id
                if bool(done.all()):
                    break
            if pos + 1 < total:
                logits = model(token[:, None], caches, start=pos)[:, -1]
        return torch.stack(out, dim=1) if out else prompt.new_zeros((batch, 0))
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
