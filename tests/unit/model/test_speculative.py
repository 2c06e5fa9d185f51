"""Speculative decoding: greedy output equals the target's own; sampling keeps the target's distribution
(chi-square on a tiny vocabulary); the MTP draft proposes what the training-time MTP forward predicts."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from tessera.config import model_config
from tessera.model import build_model, generate
from tessera.model.mtp import MTPLog
from tessera.model.speculative import ModelDraft, MTPDraft, Sampler, accept_drafts, speculative_generate

CFG = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=96)


def _model(seed: int, **kw) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = build_model(model_config(**{**CFG, **kw})).eval()
    with torch.no_grad():  # peaked distributions: greedy ties are impossible, drafts disagree often
        model.output.weight.mul_(40)
    return model


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_speculative_output_is_the_targets(k):
    target, other = _model(0, mtp_depth=3), _model(1, n_layers=1)
    prompt = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(2))
    want = generate(target, prompt, 40, temperature=0)
    for draft in (ModelDraft(other), ModelDraft(target), MTPDraft(target)):
        got, stats = speculative_generate(target, draft, prompt, 40, draft_tokens=k)
        assert torch.equal(got, want), type(draft).__name__
        assert stats.rounds >= 1 and 0 <= stats.accepted <= stats.proposed
    _, stats = speculative_generate(target, ModelDraft(target), prompt, 40, draft_tokens=k)
    assert stats.acceptance_rate == 1.0  # the target as its own draft: every proposal is accepted
    eos = int(want[0, 5])
    got, _ = speculative_generate(target, MTPDraft(target), prompt, 40, draft_tokens=k, eos_id=eos)
    assert torch.equal(got, want[:, : int((want[0] == eos).nonzero()[0]) + 1])


def test_mtp_draft_proposes_the_training_forwards_predictions():
    model = _model(3, mtp_depth=2)
    seq = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(4))
    draft = MTPDraft(model)
    draft.start(40, "auto")
    for n in range(8, 13):  # a growing sequence, the target's states observed as decoding would
        hidden = model.hidden_states(model.tok_embeddings(seq[:, :n]))
        draft.observe(hidden[:, : n - 1], 0)
        tokens, _ = draft.propose(seq[:, :n], 2, Sampler())
        for depth in (1, 2):
            log = MTPLog()
            with torch.no_grad():
                model(torch.cat([seq[:, :n], tokens[None, : depth - 1]], dim=1), mtp=log)
            assert int(tokens[depth - 1]) == int(log.logits[depth - 1][0, n - 2].argmax())


def test_accept_rule_emits_the_target_distribution():
    """The accept/reject rule alone: whatever the draft's q, the first emitted token is distributed as p."""
    gen = torch.Generator().manual_seed(8)
    vocab, k, draws = 6, 3, 6000
    p = torch.softmax(1.5 * torch.randn(k + 1, vocab, generator=gen), -1)
    q = torch.softmax(1.5 * torch.randn(k, vocab, generator=gen), -1)
    sampler = Sampler(temperature=1.0, generator=gen)
    counts = torch.zeros(vocab)
    for _ in range(draws):
        drafts = torch.stack([torch.multinomial(q[i], 1, generator=gen)[0] for i in range(k)])
        count, token = accept_drafts(p, q, drafts, sampler)
        counts[int(drafts[0]) if count else int(token)] += 1
    assert chisquare(counts.numpy(), (p[0] * draws).numpy()).pvalue > 1e-3


def _joint(target: torch.nn.Module, prompt: torch.Tensor, sampler: Sampler, vocab: int, n: int) -> torch.Tensor:
    """The target's exact distribution of its first ``n`` sampled tokens, (vocab ** n,)."""
    joint = torch.ones(1)
    with torch.no_grad():
        for length in range(n):
            rows = torch.cartesian_prod(*[torch.arange(vocab)] * length).view(-1, length) if length else None
            seqs = prompt if rows is None else torch.cat([prompt.expand(rows.shape[0], -1), rows], dim=1)
            joint = (joint[:, None] * sampler.probs(target(seqs)[:, -1])).flatten()
    return joint


def test_speculative_sampling_keeps_the_target_distribution():
    vocab, runs, n = 3, 500, 3
    target, draft = _model(5, vocab_size=vocab, dim=16, n_layers=1), _model(6, vocab_size=vocab, dim=16, n_layers=1)
    with torch.no_grad():  # milder than the greedy tests' peaks: drafts are rejected about half the time
        target.output.weight.div_(8)
        draft.output.weight.div_(8)
    sampler = Sampler(temperature=1.0, generator=torch.Generator().manual_seed(7))
    prompt = torch.tensor([[1, 2]])
    want = _joint(target, prompt, sampler, vocab, n)
    counts = torch.zeros(vocab**n)
    accepted = proposed = 0
    for _ in range(runs):
        out, stats = speculative_generate(target, ModelDraft(draft), prompt, n, draft_tokens=2, sampler=sampler)
        counts[sum(int(t) * vocab ** (n - 1 - i) for i, t in enumerate(out[0]))] += 1
        accepted, proposed = accepted + stats.accepted, proposed + stats.proposed
    assert 0.1 < accepted / proposed < 0.9, accepted / proposed  # both branches of the rule ran many times
    assert chisquare(counts.numpy(), (want / want.sum() * runs).numpy()).pvalue > 1e-3


def test_speculative_decoding_refuses_what_it_cannot_do():
    target = _model(0)
    with pytest.raises(ValueError, match="one prompt"):
        speculative_generate(target, ModelDraft(target), torch.zeros(2, 3, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="mtp_depth"):
        MTPDraft(target)
    mamba = build_model(model_config(**{**CFG, "layer_pattern": "MA", "mamba": {"state": 4}}))
    with pytest.raises(ValueError, match="Mamba"):
        ModelDraft(mamba)
