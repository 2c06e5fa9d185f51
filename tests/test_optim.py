"""Parameter groups and learning-rate schedules."""

from __future__ import annotations

import math

import pytest

from tessera.config import model_config, OptimConfig
from tessera.model import build_model
from tessera.train.optim import build_optimizer, build_scheduler, lr_multiplier, parameter_groups


def test_no_weight_decay_on_norms_biases_and_embeddings():
    model = build_model(model_config(vocab_size=300, dim=32, n_layers=1, n_heads=2, qkv_bias=True, tie_embeddings=False))
    decay, no_decay = parameter_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decay_names = {names[id(p)] for p in decay["params"]}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    assert "tok_embeddings.weight" in no_decay_names and "norm.weight" in no_decay_names
    assert "layers.0.attention.q_proj.bias" in no_decay_names
    assert "output.weight" in decay_names and "layers.0.feed_forward.up_proj.weight" in decay_names
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert len(decay_names) + len(no_decay_names) == len(list(model.parameters()))


def test_tied_embedding_counted_once_without_decay():
    model = build_model(model_config(vocab_size=300, dim=32, n_layers=1, n_heads=2, tie_embeddings=True))
    decay, no_decay = parameter_groups(model, 0.1)
    assert all(p is not model.tok_embeddings.weight for p in decay["params"])
    assert sum(p is model.tok_embeddings.weight for p in no_decay["params"]) == 1


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant", "wsd"])
def test_schedules_warm_up_then_reach_their_floor(schedule):
    cfg = OptimConfig(schedule=schedule, warmup_steps=10, min_lr_ratio=0.1, decay_fraction=0.2)
    values = [lr_multiplier(s, cfg, 100) for s in range(101)]
    assert values[0] == pytest.approx(0.1) and values[9] == pytest.approx(1.0)
    assert all(a <= b for a, b in zip(values[:10], values[1:10]))
    end = 1.0 if schedule == "constant" else 0.1
    assert values[100] == pytest.approx(end)
    if schedule == "cosine":
        assert values[55] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    if schedule == "wsd":
        assert values[79] == 1.0 and values[90] == pytest.approx(0.55)


def test_scheduler_drives_the_optimizer_lr():
    model = build_model(model_config(vocab_size=300, dim=32, n_layers=1, n_heads=2))
    cfg = OptimConfig(lr=1e-3, warmup_steps=4, schedule="linear")
    opt = build_optimizer(model, cfg)
    sched = build_scheduler(opt, cfg, 20)
    seen = []
    for _ in range(5):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])
