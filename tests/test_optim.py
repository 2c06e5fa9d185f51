"""Parameter groups, learning-rate schedules, and AdamW's kernels (fused, foreach, for-loop) giving one result."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from tessera.config import ConfigError, MuonConfig, OptimConfig, model_config
from tessera.model import build_model
from tessera.train.optim import (
    adamw_kernel,
    build_optimizer,
    build_scheduler,
    lr_multiplier,
    parameter_groups,
)


def test_no_weight_decay_on_norms_biases_and_embeddings():
    model = build_model(
        model_config(vocab_size=300, dim=32, n_layers=1, n_heads=2, qkv_bias=True, tie_embeddings=False)
    )
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


def _adamw_runs(implementation: str, scaler: bool, name: str = "adamw") -> list[torch.Tensor]:
    """Five steps of a tiny decoder with ``optim.implementation`` (one with an overflowed gradient)."""
    torch.manual_seed(0)
    model = build_model(model_config(vocab_size=300, dim=32, n_layers=2, n_heads=2, tie_embeddings=False))
    # Newton-Schulz in fp32: in bf16 it would amplify the kernels' last-bit differences past 1e-6
    cfg = OptimConfig(name=name, lr=1e-2, implementation=implementation, muon=MuonConfig(ns_dtype="fp32"))
    opt = build_optimizer(model, cfg)
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, enabled=scaler)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 300, (2, 17), generator=gen)
    for step in range(5):
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        grad_scaler.scale(loss).backward()
        if step == 2 and scaler:
            model.norm.weight.grad[0] = float("inf")  # the scaler must skip this update, in every kernel
        grad_scaler.unscale_(opt)
        grad_scaler.step(opt)
        grad_scaler.update()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(("scaler", "name"), [(False, "adamw"), (True, "adamw"), (False, "muon")])
def test_fused_and_foreach_adamw_match_the_for_loop(scaler, name):
    """torch.optim.AdamW's kernels, and Muon's AdamW part (embeddings, head, norms) through them vs tessera's loop."""
    want = _adamw_runs("for-loop", scaler, name)
    for implementation in ("fused", "foreach", "auto"):
        got = _adamw_runs(implementation, scaler, name)
        for a, b in zip(got, want):
            assert (a - b).abs().max().item() <= 1e-6, f"{implementation}: params differ from the for-loop"


def test_auto_picks_the_fused_kernel_on_cpu_and_a_bad_choice_is_one_clear_error(tiny_config):
    model = build_model(model_config(vocab_size=300, dim=32, n_layers=1, n_heads=2))
    assert build_optimizer(model, OptimConfig()).defaults["fused"] is True
    assert build_optimizer(model, OptimConfig(implementation="foreach")).defaults["foreach"] is True
    # inside DeepSpeed's optimizer wrapper: torch's default kernel
    assert not build_optimizer(model, OptimConfig(), fused_ok=False).defaults["fused"]
    with pytest.raises(ConfigError, match="optim.implementation='fused' is not for this optimizer's caller"):
        build_optimizer(model, OptimConfig(implementation="fused"), fused_ok=False)
    muon = build_optimizer(model, OptimConfig(name="muon"))
    assert muon.adamw_kernel == {"fused": True}  # auto: Muon's AdamW part takes the fused kernel too
    assert build_optimizer(model, OptimConfig(name="muon", implementation="for-loop")).adamw_kernel is None
    with pytest.raises(ConfigError, match="optim.implementation='fused' needs floating-point parameters"):
        build_optimizer(model.to("meta"), OptimConfig(implementation="fused"))
    with pytest.raises(ConfigError, match="optim.state_dtype='bf16' runs tessera's own update"):
        tiny_config("optim.state_dtype=bf16", "optim.implementation=fused")
    with pytest.raises(ConfigError, match="optim.implementation='foreach' needs parallel.engine='torch'"):
        tiny_config("parallel.engine=deepspeed", "optim.implementation=foreach")


def test_a_mix_of_dtensors_and_plain_tensors_keeps_torchs_default_kernel():
    """Tensor parallelism leaves some parameters whole: torch's fused AdamW refuses a mix in one step."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        model[0].weight = nn.Parameter(distribute_tensor(model[0].weight.detach(), mesh, [Shard(0)]))
        model[0].bias = nn.Parameter(distribute_tensor(model[0].bias.detach(), mesh, [Shard(0)]))
        params = list(model.parameters())
        assert adamw_kernel(params[:2], "auto") == {"fused": True}  # one mesh
        assert adamw_kernel(params, "auto") == {}  # mixed: torch's default (foreach)
        with pytest.raises(ConfigError, match="all plain tensors or all DTensors of one device mesh"):
            adamw_kernel(params, "fused")
        opt = torch.optim.AdamW(params, **adamw_kernel(params, "auto"))
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()  # the fused kernel would raise "got mixed torch.Tensor and DTensor"
        assert model[1].weight.detach().lt(1).all()  # stepped: lr 1e-3 against a gradient of ones
    finally:
        dist.destroy_process_group()
