"""Pipeline stage splitting (one process) and the config-time errors of impossible pipeline plans."""

from __future__ import annotations

import itertools
import random
import re

import pytest
import torch

from tessera.config import ConfigError
from tessera.validate import load_config
from tessera.model import build_model
from tessera.layout import cost_balanced_counts, local_stage_ids, stage_layer_counts
from tessera.plan.stages import describe_stages, stage_split
from tessera.parallel.pipeline import _stage_keys, split_model

from helpers.runs import TINY_OVERRIDES


def _config(*overrides: str):
    return load_config(None, [*TINY_OVERRIDES, "model.n_layers=4", *overrides])


def test_layer_counts_balance_or_follow_the_explicit_list():
    assert stage_layer_counts(4, 2) == [2, 2]
    assert stage_layer_counts(5, 4) == [2, 1, 1, 1]
    assert stage_layer_counts(4, 2, "1,3") == [1, 3]
    assert local_stage_ids(1, 2, 2) == [1, 3]


def _best_max_cost(costs: list[float], extra: float, n_stages: int) -> float:
    """The smallest costliest-stage cost over every contiguous split (brute force)."""
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(costs)), n_stages - 1):
        bounds = [0, *cuts, len(costs)]
        stages = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
        stages[-1] += extra
        best = min(best, max(stages))
    return best


def test_cost_balanced_split_is_optimal_and_keeps_even_counts_when_costs_are_even():
    rng = random.Random(0)
    for _ in range(200):
        n, n_stages = rng.randint(2, 9), rng.randint(1, 4)
        if n_stages > n:
            continue
        costs, extra = [rng.uniform(0.5, 3.0) for _ in range(n)], rng.choice([0.0, rng.uniform(0, 8)])
        counts = cost_balanced_counts(costs, extra, n_stages)
        assert sum(counts) == n and len(counts) == n_stages and min(counts) >= 1
        bounds = [sum(counts[:i]) for i in range(n_stages + 1)]
        stages = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
        stages[-1] += extra
        assert max(stages) == pytest.approx(_best_max_cost(costs, extra, n_stages))
    assert cost_balanced_counts([1.0] * 8, 0.0, 2) == [4, 4]
    assert cost_balanced_counts([1.0] * 8, 2.0, 2) == [5, 3]  # the head costs two blocks
    assert cost_balanced_counts([1.0] * 8, 1.0, 4) == [2, 2, 2, 2]  # a tie: the even split


def test_cost_split_moves_blocks_off_the_stage_with_a_large_head():
    """A 32k vocabulary on a narrow model: the last stage keeps one block; a small head changes nothing."""
    cfg = _config("parallel.pp=2", "parallel.layers_per_stage=cost", "model.n_layers=8", "model.vocab_size=32768")
    assert stage_split(cfg) == "7,1"
    assert [len(keys) for keys in _stage_keys(cfg)] == [7, 1]  # what the pipeline splits the model by
    assert "blocks per stage 7,1 (balanced FLOPs, head on the last" in describe_stages(cfg)
    small_head = _config("parallel.pp=2", "parallel.layers_per_stage=cost", "model.n_layers=8", "model.vocab_size=512")
    assert stage_split(small_head) == "4,4"
    t5 = _config("parallel.pp=2", *T5, "parallel.layers_per_stage=cost", "model.vocab_size=4096")
    assert stage_split(t5) == "6,2"  # 4 encoder blocks, then decoder blocks (cross-attention) and the head
    with pytest.raises(ConfigError, match="or 'cost'"):
        _config("parallel.pp=2", "parallel.layers_per_stage=costs")


def _assert_same_gradients(full: torch.nn.Module, forward_full, forward_stages) -> None:
    """The same loss backpropagated through the full model and through its chained stages gives every
    parameter the same gradient, and so the same grad norm (the stages share the full model's modules)."""

    def grads(forward) -> dict[str, torch.Tensor]:
        full.zero_grad(set_to_none=True)
        forward().float().square().mean().backward()
        return {n: p.grad.clone() for n, p in full.named_parameters() if p.grad is not None}

    want, got = grads(forward_full), grads(forward_stages)
    assert got.keys() == want.keys() and want
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-6, atol=1e-9, msg=name)
    norm = lambda g: torch.linalg.vector_norm(torch.stack([x.norm() for x in g.values()])).item()  # noqa: E731
    assert norm(got) == pytest.approx(norm(want), rel=1e-6)


def _chain(stages, *inputs):
    """The stages run one after another on ``inputs``."""
    out = inputs
    for stage in stages:
        out = stage(*out) if isinstance(out, tuple) else stage(out)
    return out


@pytest.mark.parametrize(
    "overrides",
    [
        ["parallel.pp_schedule=gpipe", "parallel.layers_per_stage=1,3"],
        ["parallel.pp_schedule=interleaved_1f1b", "parallel.microbatches=2"],
        ["parallel.pp_schedule=interleaved_zb", "parallel.microbatches=4"],
        ["model.arch=encoder", "model.sentinel_tokens=1", "parallel.pp_schedule=gpipe"],
        ["model.moe.experts=4", "parallel.pp_schedule=1f1b", "parallel.microbatches=2"],
        ["model.moe.experts=4", "model.vocab_size=4096", "parallel.layers_per_stage=cost"],  # 3,1
    ],
)
def test_stages_chain_to_the_full_model(overrides):
    """Running the stages one after another gives the full model's logits; names are the full model's."""
    cfg = _config("parallel.pp=2", *overrides)
    torch.manual_seed(0)
    full = build_model(cfg.model).eval()
    tokens = torch.randint(0, 500, (2, 16))
    with torch.no_grad():
        want = full(tokens)
    v = 2 if "interleaved" in cfg.parallel.pp_schedule else 1
    local0, stages0, _ = split_model(full, cfg, local_stage_ids(0, 2, v))
    local1, stages1, _ = split_model(full, cfg, local_stage_ids(1, 2, v))
    order = sorted(
        [*zip(local_stage_ids(0, 2, v), stages0), *zip(local_stage_ids(1, 2, v), stages1)], key=lambda s: s[0]
    )
    with torch.no_grad():
        h = _chain([stage for _, stage in order], tokens)
    torch.testing.assert_close(h, want, rtol=0, atol=0)
    _assert_same_gradients(full, lambda: full(tokens), lambda: _chain([stage for _, stage in order], tokens))
    names = set(local0.state_dict()) | set(local1.state_dict())
    assert names == set(full.state_dict())
    assert not set(local0.state_dict()) & set(local1.state_dict())
    assert isinstance(local0, type(full)) and isinstance(stages1[-1], type(full))  # same type, stage forward


T5 = ["model.arch=encoder_decoder", "model.sentinel_tokens=8", "model.position.kind=t5_bias"]


@pytest.mark.parametrize(
    "overrides",
    [
        ["parallel.pp_schedule=gpipe"],  # encoder | decoder
        ["parallel.pp_schedule=gpipe", "parallel.layers_per_stage=3,5"],  # a stage ends the encoder, starts the decoder
        ["parallel.pp_schedule=interleaved_1f1b", "parallel.microbatches=2", "model.n_decoder_layers=2"],
    ],
)
def test_encoder_decoder_stages_carry_decoder_ids_and_memory(overrides):
    """Stages take the encoder blocks, then the decoder's: (hidden, decoder ids) flow through the
    encoder stages, (memory, decoder hidden) through the decoder stages; chained, they give the logits."""
    cfg = _config("parallel.pp=2", *T5, "model.tie_embeddings=true", *overrides)
    torch.manual_seed(0)
    full = build_model(cfg.model).eval()
    enc, dec = torch.randint(0, 500, (2, 16)), torch.randint(0, 500, (2, 12))
    with torch.no_grad():
        want = full(enc, dec)
    v = 2 if "interleaved" in cfg.parallel.pp_schedule else 1
    stages = {}
    for rank in range(2):
        local, own, _ = split_model(full, cfg, local_stage_ids(rank, 2, v))
        stages.update(zip(local_stage_ids(rank, 2, v), own))
        assert set(local.state_dict()) <= set(full.state_dict())
    last = stages[max(stages)]
    assert stages[0].decoder is None and stages[0].output is None and last.output is not None
    assert (last.encoder is not None) == ("3,5" in cfg.parallel.layers_per_stage)  # the mixed stage holds both
    chained = [stages[s] for s in sorted(stages)]
    with torch.no_grad():
        out = _chain(chained, enc, dec)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    _assert_same_gradients(full, lambda: full(enc, dec), lambda: _chain(chained, enc, dec))


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["parallel.pp=8"], "every stage needs a block"),
        (["parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.microbatches=1"], "microbatches >= pp"),
        (["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.microbatches=3"], "multiple of pp=2"),
        (
            ["parallel.pp=2", "parallel.pp_schedule=interleaved_zb", "parallel.pp_virtual_stages=1"],
            "needs several stages per rank",
        ),
        (["parallel.pp=2", "parallel.pp_schedule=gpipe", "parallel.pp_virtual_stages=2"], "runs one stage per rank"),
        (
            ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=4"],
            "every stage needs a block",
        ),
        (["parallel.pp=2", "parallel.layers_per_stage=2,1"], "summing to model.n_layers=4"),
        (["parallel.pp=2", "parallel.layers_per_stage=4,0"], "positive block counts"),
        (
            ["parallel.pp=2", "parallel.dp_shard=2", "parallel.microbatches=4", "train.batch_size=4"],
            "not divisible by the data-parallel degree 2 x parallel.microbatches=4",
        ),
        (["parallel.pp=16", *T5], "but model.n_layers + n_decoder_layers=8"),
    ],
)
def test_impossible_pipeline_plans_fail_at_config_time(overrides, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        _config(*overrides)


def test_stage_forward_needs_no_process_group():
    """The split is plain module surgery: shared modules, nothing copied."""
    cfg = _config("parallel.pp=2")
    full = build_model(cfg.model)
    local, (stage,), _ = split_model(full, cfg, [1])
    assert stage.layers["2"] is full.layers["2"] and list(stage.layers) == ["2", "3"]
    assert stage.tok_embeddings is None and stage.output is full.output
    assert local.layers["3"] is full.layers["3"]
