"""Objectives as collators: causal LM, masked LM (80/10/10) and T5 span corruption."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tessera.config import model_config
from tessera.data.objectives import span_count, span_lengths
from tessera.data.objectives import IGNORE, Objective, causal_lm, masked_lm, span_corruption


@dataclass
class _Batch:
    tokens: torch.Tensor
    loss_mask: torch.Tensor | None = None

    def model_kwargs(self) -> dict:
        return {}


def test_causal_lm_shifts():
    x = torch.arange(10).view(2, 5)
    inputs, labels = causal_lm(x)
    assert torch.equal(inputs, x[:, :-1]) and torch.equal(labels, x[:, 1:])


def test_masked_lm_80_10_10():
    tokens = torch.randint(0, 500, (64, 256), generator=torch.Generator().manual_seed(0))
    generators = [torch.Generator().manual_seed(i) for i in range(64)]
    inputs, labels = masked_lm(tokens, mask_id=511, n_real=500, prob=0.15, generators=generators)
    chosen = labels != IGNORE
    assert chosen.float().mean().item() == pytest.approx(0.15, abs=0.01)
    assert torch.equal(labels[chosen], tokens[chosen])
    assert torch.equal(inputs[~chosen], tokens[~chosen])
    masked = (inputs == 511) & chosen
    kept = (inputs == tokens) & chosen
    n = chosen.sum().item()
    assert masked.sum().item() / n == pytest.approx(0.8, abs=0.03)
    assert kept.sum().item() / n == pytest.approx(0.1 + 0.1 / 500, abs=0.03)  # kept, or replaced by itself
    assert int(inputs.max()) <= 511 and int(inputs[~masked].max()) < 500


def test_span_corruption_round_trips():
    tokens = torch.randint(0, 400, (4, 65), generator=torch.Generator().manual_seed(0))
    generators = [torch.Generator().manual_seed(i) for i in range(4)]
    enc, dec, labels = span_corruption(tokens, vocab_size=520, density=0.15, mean_span=3.0, generators=generators)
    spans = span_count(65, 0.15, 3.0)
    noise = round(65 * 0.15)
    assert enc.shape == (4, 65 - noise + spans) and labels.shape == (4, noise + spans)
    assert torch.equal(dec[:, 1:], labels[:, :-1]) and bool((dec[:, 0] == 0).all())
    for row in range(4):
        sentinels = [t for t in enc[row].tolist() if t >= 520 - spans]
        assert sentinels == [519 - k for k in range(spans)]
        # Put the spans back where their sentinels are: the original row comes out.
        target, pieces, current = labels[row].tolist(), {}, None
        for t in target:
            if t >= 520 - spans:
                current = t
                pieces[current] = []
            else:
                pieces[current].append(t)
        rebuilt = [t for s in enc[row].tolist() for t in (pieces[s] if s in pieces else [s])]
        assert rebuilt == tokens[row].tolist()


def test_objective_collator_is_deterministic_and_follows_arch():
    tokens = torch.randint(0, 500, (2, 33))
    mlm = Objective(model_config(arch="encoder", vocab_size=520, sentinel_tokens=8), seed=3)
    (a,), _, la, mask = mlm(_Batch(tokens))
    (b,), _, lb, _ = mlm(_Batch(tokens))
    assert torch.equal(a, b) and torch.equal(la, lb) and a.shape == (2, 32)
    assert torch.equal(mask, la != IGNORE)
    t5 = Objective(model_config(arch="encoder_decoder", vocab_size=520, sentinel_tokens=8), seed=3)
    args, kwargs, labels, mask = t5(_Batch(tokens))
    assert len(args) == 2 and kwargs == {} and mask is None
    clm = Objective(model_config(), seed=3)
    (inputs,), _, labels, _ = clm(_Batch(tokens))
    assert torch.equal(labels, tokens[:, 1:])


@pytest.mark.parametrize("arch", ["encoder", "encoder_decoder"])
def test_masks_are_drawn_per_sequence_so_a_data_parallel_split_changes_nothing(arch):
    """Each rank of a data-parallel job collates its rows of the global batch: the masks must be those
    the whole batch gets on one process (the condition for BERT / T5 parity across dp sizes)."""
    tokens = torch.randint(0, 500, (4, 33), generator=torch.Generator().manual_seed(0))
    objective = Objective(model_config(arch=arch, vocab_size=520, sentinel_tokens=8), seed=3)
    whole = objective(_Batch(tokens))
    halves = [objective(_Batch(part)) for part in tokens.chunk(2)]
    for i, arg in enumerate(whole[0]):
        assert torch.equal(arg, torch.cat([h[0][i] for h in halves]))
    assert torch.equal(whole[2], torch.cat([h[2] for h in halves]))
    other = Objective(model_config(arch=arch, vocab_size=520, sentinel_tokens=8), seed=4)
    assert not torch.equal(other(_Batch(tokens))[2], whole[2])  # the seed still matters


@pytest.mark.parametrize("length", [17, 33, 62, 65])
def test_span_lengths_are_the_shapes_span_corruption_makes(length):
    tokens = torch.arange(2 * length).view(2, length)
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    enc, dec, labels = span_corruption(tokens, 520, 0.15, 3.0, gens)
    assert (enc.shape[1], dec.shape[1]) == span_lengths(length, 0.15, 3.0) and labels.shape == dec.shape
