"""The weight-only schemes (torchao ``quantize_`` configs), applied to a tessera model, and the
reading of a torchao-quantized HF directory back into a quantized tessera model.

Which linears: every ``nn.Linear`` but the output head (transformers' ``modules_to_not_convert =
["lm_head"]`` on the HF side); embeddings stay in full precision.

``int4-weight`` is torchao's ``IntxWeightOnlyConfig(int4, PerGroup(group_size))``: int4 values with one
scale per group, stored unpacked in int8 and dequantized in the matmul. It is the int4 layout that
runs on CPU in torchao 0.18 (``Int4WeightOnlyConfig`` needs CUDA: its plain and tile-packed layouts
have no CPU kernel), and the same file loads on a GPU.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tessera.errors import ConfigError

SCHEMES = ("int8-weight", "int4-weight", "fp8")
DEFAULT_GROUP_SIZE = 32
HEAD_NAMES = ("output",)  # tessera's head; lm_head on the HF side


def torchao_config(scheme: str, group_size: int = DEFAULT_GROUP_SIZE) -> Any:
    """torchao's ``quantize_`` config of ``scheme`` (see the module docstring for int4)."""
    from tessera.parallel.fp8 import import_torchao

    import_torchao()
    from torchao.quantization import (
        Float8WeightOnlyConfig,
        Int8WeightOnlyConfig,
        IntxWeightOnlyConfig,
    )
    from torchao.quantization.granularity import PerGroup

    if scheme == "int8-weight":
        return Int8WeightOnlyConfig()
    if scheme == "int4-weight":
        return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group_size))
    if scheme == "fp8":
        return Float8WeightOnlyConfig()
    raise ConfigError(f"--scheme {scheme!r} is not one of {', '.join(SCHEMES)}")


def quantized_linear(module: nn.Module, fqn: str) -> bool:
    """Whether ``module`` (named ``fqn``) is quantized: a linear that is not the head."""
    return isinstance(module, nn.Linear) and fqn.split(".")[-1] not in HEAD_NAMES


def check_scheme(model: nn.Module, scheme: str, group_size: int) -> None:
    """One line when ``scheme`` cannot quantize ``model`` (int4: a group size not dividing an input dimension)."""
    if scheme not in SCHEMES:
        raise ConfigError(f"--scheme {scheme!r} is not one of {', '.join(SCHEMES)}")
    if scheme != "int4-weight":
        return
    if group_size <= 0:
        raise ConfigError(f"--group-size must be positive, got {group_size}")
    for fqn, module in model.named_modules():
        if quantized_linear(module, fqn) and module.in_features % group_size:
            raise ConfigError(
                f"--group-size {group_size} does not divide the input dimension {module.in_features} of {fqn}; "
                f"use a divisor of {module.in_features} (e.g. 32)"
            )


def quantize_model(model: nn.Module, scheme: str, group_size: int = DEFAULT_GROUP_SIZE) -> nn.Module:
    """Quantize ``model``'s linears (not the head) in place with ``scheme``; returns it."""
    check_scheme(model, scheme, group_size)
    from torchao.quantization import quantize_

    quantize_(model, torchao_config(scheme, group_size), filter_fn=quantized_linear)
    return model


def quantization_config(path: str | Path) -> dict | None:
    """The torchao ``quantization_config`` of an HF directory's config.json, or None."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    try:
        data = json.loads(config.read_text(encoding="utf-8")).get("quantization_config")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None
    return data if isinstance(data, dict) and data.get("quant_method") == "torchao" else None


def load_quantized_hf(path: str | Path) -> nn.Module:
    """The quantized tessera model of a torchao-quantized HF directory (eval mode, CPU).

    The stored tensors are dequantized and mapped to tessera names (which fixes the model config and
    every plain tensor), the model is quantized with the stored config, and then each quantized weight
    that the mapping only renamed takes the stored torchao tensor itself: tessera computes with the
    very integers and scales transformers loads (quantizing the dequantized values again would not
    give back the same scales).
    """
    from tessera.hf.weights import HFConversionError, load_state, state_from_hf
    from tessera.model import build_model

    quant = quantization_config(path)
    if quant is None:
        raise HFConversionError(f"'{path}' is not a torchao-quantized HF directory (no quantization_config)")
    from torchao.core.config import config_from_dict
    from torchao.quantization import quantize_

    hf_config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    plain, stored = _dequantized_tensors(Path(path))
    cfg, state, _ = state_from_hf(hf_config, plain, Path(path) / "config.json")
    model = build_model(cfg)
    load_state(model, state)
    quantize_(model, config_from_dict(quant["quant_type"]["default"]), filter_fn=quantized_linear)
    for name, tensor in state.items():
        original = stored.get(tensor.data_ptr())
        owner, _, leaf = name.rpartition(".")
        if original is not None and original.shape == tensor.shape:
            setattr(model.get_submodule(owner), leaf, nn.Parameter(original, requires_grad=False))
    return model.eval()


def _dequantized_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[int, torch.Tensor]]:
    """HF-named fp32 tensors of the directory's safetensors files (torchao tensors dequantized), and the
    torchao tensors by the address of their dequantized copy."""
    from safetensors import safe_open
    from torchao.prototype.safetensors.safetensors_support import (
        unflatten_tensor_state_dict,
    )

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"'{path}' has no .safetensors files; re-run tessera convert quantize")
    tensors: dict[str, torch.Tensor] = {}
    stored: dict[int, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            data = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118 (a handle, not a dict)
            metadata = handle.metadata() or {}
        restored, _ = unflatten_tensor_state_dict(data, metadata)
        for name, tensor in restored.items():
            if type(tensor) is torch.Tensor:
                tensors[name] = tensor.float()
                continue
            tensors[name] = tensor.dequantize().float().contiguous()
            stored[tensors[name].data_ptr()] = tensor
    return tensors, stored
