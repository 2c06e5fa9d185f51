"""Quantization-aware training through torchao's QAT fake-quantizers (``torchao.quantization.qat``).

Applied by :func:`tessera.parallel.parallelize` first, before TP, compile and FSDP (like float8): the
block linears become torchao ``FakeQuantizedLinear`` modules, whose weights are rounded to the grid
of the scheme in the forward pass (straight-through gradient). The parameters keep their names, so
checkpoints are those of the plain model and ``tessera convert quantize`` turns the trained weights
into the real quantized model with the same scheme (same scales, same integers).

Which linears: every ``nn.Linear`` but the output head, as ``tessera convert quantize`` does.

* ``int8-weight``: ``IntxFakeQuantizeConfig(int8, per_channel, symmetric)``, the fake-quantizer of
  what ``Int8WeightOnlyConfig`` (the convert scheme) stores: int8 per row, one scale per row.
  (torchao cannot infer it from ``Int8WeightOnlyConfig``, so it is named here.)
* ``int4-weight``: inferred by ``QATConfig`` from the convert scheme itself,
  ``IntxWeightOnlyConfig(int4, PerGroup(train.qat_group_size))``.

``train.qat_start``: fake quantization is off until that many steps are done (the plain linear,
bit for bit), on after; :func:`set_qat_step` decides it from the step alone, so a resumed run
switches at the same step.
"""

from __future__ import annotations

import torch
from torch import nn

QAT_SCHEMES = ("int8-weight", "int4-weight")
_HEAD_NAMES = ("output",)  # the head stays in full precision (as in tessera.quantize.schemes)


def qat_linear(module: nn.Module, fqn: str) -> bool:
    """Whether ``module`` (named ``fqn``) is fake-quantized: a linear that is not the head."""
    return isinstance(module, nn.Linear) and fqn.split(".")[-1] not in _HEAD_NAMES


def qat_config(scheme: str, group_size: int):
    """torchao's ``QATConfig`` (prepare step) of ``scheme`` (see the module docstring)."""
    from tessera.parallel.fp8 import import_torchao

    import_torchao()
    from torchao.quantization import IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerGroup
    from torchao.quantization.qat import IntxFakeQuantizeConfig, QATConfig

    if scheme == "int8-weight":
        weight = IntxFakeQuantizeConfig(torch.int8, granularity="per_channel", is_symmetric=True)
        return QATConfig(weight_config=weight, step="prepare")
    if scheme == "int4-weight":
        base = IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group_size))
        return QATConfig(base, step="prepare")
    raise ValueError(f"train.qat={scheme!r} is not one of {', '.join(QAT_SCHEMES)}")


def apply_qat(model: nn.Module, scheme: str, group_size: int, start: int) -> list[str]:
    """Swap ``model``'s block linears for torchao fake-quantized ones (off until ``start`` steps are
    done); the names of the swapped linears."""
    from torchao.quantization import quantize_

    names = [fqn for fqn, module in model.named_modules() if qat_linear(module, fqn)]
    quantize_(model, qat_config(scheme, group_size), filter_fn=qat_linear)
    set_qat_step(model, 0, start)
    return names


def set_qat_step(model: nn.Module, step: int, start: int) -> None:
    """Fake quantization on for the step after ``step`` completed steps when ``step >= start``."""
    from torchao.quantization.qat.linear import FakeQuantizedLinear

    enabled = step >= start
    for module in model.modules():
        if isinstance(module, FakeQuantizedLinear) and module.weight_fake_quantizer is not None:
            module.weight_fake_quantizer.enabled = enabled
