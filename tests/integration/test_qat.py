"""Quantization-aware training (torchao QAT fake-quantizers): one layer against torchao, the trainer, convert, bad input."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from helpers.runs import TINY_OVERRIDES, run_cli, step_losses
from torch import nn

from tessera.config import ConfigError
from tessera.model import build_model
from tessera.parallel.fp8 import import_torchao
from tessera.parallel.qat import apply_qat, set_qat_step
from tessera.train.trainer import train
from tessera.validate import load_config

import_torchao()
QAT_QUICK = ["train.eval_every=0", "optim.schedule=constant", "train.batch_size=8", "train.seq_len=32"]


def _reference(layer: nn.Linear, scheme: str) -> nn.Module:
    """torchao's own QAT linear of the convert scheme, built without tessera's helpers."""
    from torchao.quantization import IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerGroup
    from torchao.quantization.qat import IntxFakeQuantizeConfig, QATConfig

    ref = nn.Sequential(copy.deepcopy(layer))
    if scheme == "int4-weight":
        config = QATConfig(IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)), step="prepare")
    else:
        weight = IntxFakeQuantizeConfig(torch.int8, granularity="per_channel", is_symmetric=True)
        config = QATConfig(weight_config=weight, step="prepare")
    quantize_(ref, config)
    return ref


def _forward_backward(layer: nn.Module, x: torch.Tensor, grad_out: torch.Tensor):
    x = x.clone().requires_grad_(True)
    y = layer(x)
    y.backward(grad_out)
    weight = next(p for name, p in layer.named_parameters() if name.endswith("weight"))
    return y.detach(), x.grad, weight.grad


@pytest.mark.parametrize("scheme", ["int8-weight", "int4-weight"])
def test_qat_linear_matches_torchao_and_is_plain_before_qat_start(scheme):
    torch.manual_seed(0)
    model = build_model(load_config(None, [*TINY_OVERRIDES, "model.n_layers=1"]).model)
    name = "layers.0.attention.q_proj"
    plain = copy.deepcopy(model.get_submodule(name))
    names = apply_qat(model, scheme, 32, start=3)
    assert name in names and "output" not in names and type(model.output) is nn.Linear
    layer, ref = model.get_submodule(name), _reference(plain, scheme)
    torch.manual_seed(1)
    x, grad_out = torch.randn(2, 32, plain.in_features), torch.randn(2, 32, plain.out_features)
    for step in (0, 2):  # before train.qat_start: the plain linear, bit for bit
        set_qat_step(model, step, 3)
        for got, want in zip(
            _forward_backward(layer, x, grad_out), _forward_backward(copy.deepcopy(plain), x, grad_out)
        ):
            assert torch.equal(got, want)
        layer.weight.grad = None
    set_qat_step(model, 3, 3)
    got, want = _forward_backward(layer, x, grad_out), _forward_backward(ref, x, grad_out)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert not torch.allclose(got[0], plain(x)), "fake quantization changed nothing"


def test_trainer_with_qat_trains_and_resumes_bitwise_across_qat_start(tiny_config, tmp_path):
    args = [
        *QAT_QUICK,
        "train.qat=int4-weight",
        "train.qat_start=3",
        "checkpoint.every=2",
        "checkpoint.keep_last=8",
        "optim.lr=3e-3",
    ]
    full = train(tiny_config(*args, "train.steps=8", run_dir=tmp_path / "full"))
    losses = step_losses(tmp_path / "full")
    assert losses[-1] < losses[0] - 0.3, losses
    plain = train(
        tiny_config(*QAT_QUICK, "checkpoint.every=2", "optim.lr=3e-3", "train.steps=8", run_dir=tmp_path / "p")
    )
    assert plain.losses[:3] == full.losses[:3] and plain.losses[3] != full.losses[3]  # on from step 4 exactly
    half = tmp_path / "half"  # the full run stopped after step 2 (qat_start must lie within train.steps)
    shutil.copytree(tmp_path / "full", half)
    for later in sorted((half / "checkpoints").glob("step_*"))[1:]:
        shutil.rmtree(later)
    resumed = train(tiny_config(*args, "train.steps=8", run_dir=half))
    assert resumed.losses == full.losses[2:]  # exact float equality across the switch at step 3


def test_convert_of_a_qat_run_is_the_fake_quantized_model(tiny_config, tmp_path):
    from tessera.api import load
    from tessera.quantize.convert import quantize_run, run_scheme

    run = tmp_path / "run"
    train(tiny_config(*QAT_QUICK, "train.qat=int8-weight", "train.steps=4", "optim.lr=3e-3", run_dir=run))
    scheme, group = run_scheme(run, None, None)
    assert scheme == "int8-weight"
    trained = load(run)
    apply_qat(trained, scheme, group, start=0)
    ids = torch.tensor([[5, 17, 42, 9, 3, 11]])
    quantized = load(quantize_run(run, tmp_path / "q", scheme, group))
    with torch.no_grad():
        torch.testing.assert_close(quantized(ids), trained(ids), rtol=1e-4, atol=1e-4)
    with pytest.raises(ConfigError, match="convert it with --scheme int8-weight"):
        run_scheme(run, "int4-weight", None)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.qat=int8-weight", "parallel.engine=deepspeed"], "does not support it"),
        (["train.qat=int4-weight", "train.qat_group_size=48"], "train.qat_group_size=48 does not divide"),
        (["train.qat=int8-weight", "train.fp8=tensorwise"], "set one of them off"),
        (["train.qat=int8-weight", "train.steps=10", "train.qat_start=10"], "must be in [0, train.steps=10)"),
    ],
)
def test_bad_qat_input_is_one_line(tiny_config, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")) as err:
        tiny_config(*overrides)
    assert "\n" not in str(err.value)


def test_bad_qat_cli_exit_2(tmp_path):
    result = run_cli("train", "configs/smoke.toml", "train.qat=int4-weight", "train.qat_group_size=48")
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "train.qat_group_size=48 does not divide" in lines[0], lines
