"""fp8 training (torchao float8 / MXFP8, emulated on CPU): numerics of one layer, the trainer, bad input.

The layer tests compare tessera's conversion (the rule of which linears, the emulation switch)
against torchao applied by hand to the same layer, and tensorwise against a from-scratch
reference of the fp8 casts, so a change in what is converted or how is visible here.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from helpers.runs import (
    TINY_OVERRIDES,
    step_losses,
    step_records,
    torchrun,
    write_tiny_recipe,
)
from torch import nn

from tessera.config import ConfigError
from tessera.model import build_model
from tessera.parallel.fp8 import (
    convert_float8,
    convert_mxfp8,
    import_torchao,
)
from tessera.train.trainer import train
from tessera.validate import load_config

import_torchao()
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_QUICK = ["train.eval_every=0", "optim.schedule=constant", "train.batch_size=8", "train.seq_len=32"]


def _tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return build_model(load_config(None, [*TINY_OVERRIDES, "model.n_layers=1"]).model)


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Tensorwise fp8 cast and back: scale = max(dtype) / amax, saturated (torchao's dynamic scaling)."""
    amax = t.abs().max().to(torch.float64).clamp(min=1e-12)
    scale = (torch.finfo(dtype).max / amax).to(torch.float32)
    return (t * scale).clamp(torch.finfo(dtype).min, torch.finfo(dtype).max).to(dtype).float() / scale


def _torchao_float8(recipe: str):
    """torchao's own recipe, emulated: the reference, built without tessera's helpers."""
    from torchao.float8 import Float8LinearConfig

    return dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)


def _forward_backward(layer: nn.Module, x: torch.Tensor, grad_out: torch.Tensor):
    x = x.clone().requires_grad_(True)
    y = layer(x)
    y.backward(grad_out)
    return y.detach(), x.grad, layer.weight.grad


def _layer_and_inputs(model: nn.Module, name: str):
    layer = model.get_submodule(name)
    torch.manual_seed(1)
    x = torch.randn(2, 32, layer.in_features)
    return layer, x, torch.randn(2, 32, layer.out_features)


def test_tensorwise_layer_matches_torchao_and_the_fp8_cast_reference():
    plain = _tiny_model()
    converted = copy.deepcopy(plain)
    names = convert_float8(converted, "tensorwise", "cpu", fsdp_all_gather=False)
    assert "layers.0.feed_forward.up_proj" in names and "output" not in names
    by_hand = nn.Linear(64, 192, bias=False)
    layer, x, go = _layer_and_inputs(converted, "layers.0.feed_forward.up_proj")
    by_hand.weight.data.copy_(plain.get_submodule("layers.0.feed_forward.up_proj").weight)
    from torchao.float8 import convert_to_float8_training

    reference = convert_to_float8_training(nn.Sequential(by_hand), config=_torchao_float8("tensorwise"))[0]
    got, want = _forward_backward(layer, x, go), _forward_backward(reference, x, go)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    w = by_hand.weight.detach()
    y = _cast(x, E4M3) @ _cast(w, E4M3).T
    grad_x = _cast(go, E5M2) @ _cast(w, E4M3)
    grad_w = _cast(go, E5M2).flatten(0, 1).T @ _cast(x, E4M3).flatten(0, 1)
    for a, b in zip(got, (y, grad_x, grad_w)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert (got[0] - x @ w.T).abs().max() > 1e-3  # the fp8 casts were in effect


@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8"])
def test_rowwise_and_mxfp8_layers_match_torchao(recipe):
    plain = _tiny_model()
    converted = copy.deepcopy(plain)
    if recipe == "mxfp8":
        convert_mxfp8(converted, "cpu")
    else:
        convert_float8(converted, recipe, "cpu", fsdp_all_gather=False)
    name = "layers.0.attention.q_proj"
    layer, x, go = _layer_and_inputs(converted, name)
    reference = nn.Sequential(copy.deepcopy(plain.get_submodule(name)))
    if recipe == "mxfp8":
        from torchao.prototype.moe_training.config import (
            MXFP8TrainingOpConfig,
            MXFP8TrainingRecipe,
        )
        from torchao.quantization import quantize_

        quantize_(reference, MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL))
    else:
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(reference, config=_torchao_float8(recipe))
    got, want = _forward_backward(layer, x, go), _forward_backward(reference[0], x, go)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    exact = x @ plain.get_submodule(name).weight.detach().T
    assert (got[0] - exact).abs().max() > 1e-3


def test_the_head_router_and_small_matrices_stay_in_high_precision():
    model = build_model(load_config(None, [*TINY_OVERRIDES, "model.n_layers=1", "model.n_kv_heads=1"]).model)
    names = convert_float8(model, "tensorwise", "cpu", fsdp_all_gather=False)
    assert "layers.0.attention.k_proj" not in names  # 64 x 16: a side under MIN_FP8_DIM
    assert "layers.0.attention.q_proj" in names and "output" not in names
    assert type(model.output) is nn.Linear or model.output is None


def test_trainer_with_fp8_trains_and_resumes_bitwise(tiny_config, tmp_path):
    args = [*FP8_QUICK, "train.fp8=tensorwise", "checkpoint.every=4", "optim.lr=3e-3"]
    full = train(tiny_config(*args, "train.steps=8", run_dir=tmp_path / "full"))
    losses = step_losses(tmp_path / "full")
    assert losses[-1] < losses[0] - 0.3, losses
    half = tmp_path / "half"
    train(tiny_config(*args, "train.steps=4", run_dir=half))
    resumed = train(tiny_config(*args, "train.steps=8", run_dir=half))
    assert resumed.losses == full.losses[4:]  # exact float equality, step by step


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.fp8=tensorwise", "model.dim=72", "model.n_heads=4"], "model.dim=72; change model.dim"),
        (["train.fp8=rowwise", "parallel.engine=deepspeed"], "does not support it"),
        (["train.fp8=mxfp8", "model.multiple_of=16"], "divisible by 32, but model.multiple_of=16"),
    ],
)
def test_bad_fp8_input_is_one_line(tiny_config, overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        tiny_config(*overrides)
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_fp8_under_fsdp_and_tp_matches_fp8_in_one_process(tmp_path, cache_dir):
    """Same tolerance as the bf16 layouts (tests/integration/test_precision.py): FSDP 2e-4 loss / 1e-2 grad norm,
    TP 1e-4 / 3e-3."""
    job = [*FP8_QUICK, "train.steps=4", "checkpoint.enabled=false"]
    recipe = write_tiny_recipe(tmp_path / "job.toml", cache_dir, *job)
    variants = {}
    for fp8 in ("tensorwise", "rowwise", "mxfp8"):
        variants[f"fsdp_{fp8}"] = ["parallel.dp_shard=2", f"train.fp8={fp8}"]
        variants[f"tp_{fp8}"] = ["parallel.dp_shard=1", "parallel.tp=2", f"train.fp8={fp8}"]
    refs = {
        fp8: train(load_config(recipe, [f"train.fp8={fp8}", f"train.run_dir={tmp_path}/single_{fp8}"])).run_dir
        for fp8 in ("tensorwise", "rowwise", "mxfp8")
    }
    torchrun(2, "tests/helpers/dist_variants.py", str(recipe), str(tmp_path), json.dumps(variants))
    for fp8, ref in refs.items():
        for layout, loss_tol, gnorm_tol in (("fsdp", 2e-4, 1e-2), ("tp", 1e-4, 3e-3)):
            run = tmp_path / f"{layout}_{fp8}"
            loss, gnorm = _max_rel(run, ref, "loss"), _max_rel(run, ref, "grad_norm")
            print(f"{layout} {fp8}: loss {loss:.1e} grad norm {gnorm:.1e}")
            assert loss <= loss_tol and gnorm <= gnorm_tol, f"{run.name}: loss {loss:.2e}, grad norm {gnorm:.2e}"


def _max_rel(run, ref, key: str) -> float:
    got, want = step_records(run), step_records(ref)
    assert [r["step"] for r in got] == [r["step"] for r in want] and got
    return max(abs(a[key] - b[key]) / abs(b[key]) for a, b in zip(got, want))
