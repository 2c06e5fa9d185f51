"""fp8 training through torchao: tensorwise / rowwise float8 linears, MXFP8 weight wrappers.

Applied by :func:`tessera.parallel.parallelize` to the built model: float8 (tensorwise, rowwise)
before tensor parallelism (torchao's TP plans expect its ``Float8Linear``), MXFP8 after it (its
weight wrapper must sit on top of the DTensor), and both before FSDP, so FSDP2 shards the
converted weights and, for tensorwise, all-gathers them in fp8 (``enable_fsdp_float8_all_gather``).

Which linears: every ``nn.Linear`` except the output head, MoE routers and matrices where fp8 does
not pay, i.e. with a side under :data:`MIN_FP8_DIM`. Every converted side must be a multiple of 16
(32 for MXFP8, its scaling block), which config validation checks before anything starts.
On CPU torchao's emulation runs (the fp8 casts and scales are real, the matmul is fp32/bf16).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch
from torch import nn

from tessera.errors import ConfigError

MIN_FP8_DIM = 64  # a linear with a side under this stays in high precision: the casts cost more than fp8 saves
FP8_RECIPES = ("tensorwise", "rowwise", "mxfp8")
_SKIPPED_NAMES = ("output", "router", "gate")  # the head; MoE routers (tiny, and their logits need precision)
# compute capability torchao's fp8 GEMMs need on CUDA: float8 scaled_mm on Ada/Hopper, MXFP8 on Blackwell
_CUDA_CAPABILITY = {"tensorwise": (8, 9), "rowwise": (8, 9), "mxfp8": (10, 0)}


def fp8_multiple(recipe: str) -> int:
    """What every converted matrix side must be a multiple of for ``recipe``."""
    return 32 if recipe == "mxfp8" else 16


def import_torchao() -> None:
    """Import torchao quietly: it logs a warning per CUDA .so it cannot load on a CPU build, and torch
    one per enum torchao registers with pytree; neither is the user's concern."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        import torchao
        import torchao.prototype.moe_training.config  # noqa: F401  (registers its enums while muted)
    except ImportError:
        raise ConfigError("train.fp8 and quantization need torchao: pip install 'tessera[lowp]'") from None
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def check_fp8_device(recipe: str, device: torch.device) -> None:
    """One line when the GPU cannot run ``recipe`` (CPU runs torchao's emulation instead)."""
    if recipe == "off" or device.type != "cuda":
        return
    need = _CUDA_CAPABILITY[recipe]
    have = torch.cuda.get_device_capability(device)
    if have < need:
        raise ConfigError(
            f"train.fp8={recipe!r} needs a GPU of compute capability {need[0]}.{need[1]} or newer "
            f"(this one is {have[0]}.{have[1]}); use train.fp8=off"
            + (" or tensorwise/rowwise (sm89+)" if recipe == "mxfp8" and have >= (8, 9) else "")
        )


def fp8_filter(recipe: str) -> Callable[[nn.Module, str], bool]:
    """The rule of which linears are converted (see the module docstring)."""
    multiple = fp8_multiple(recipe)

    def convert(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or fqn.split(".")[-1] in _SKIPPED_NAMES:
            return False
        out_dim, in_dim = module.weight.shape
        return min(out_dim, in_dim) >= MIN_FP8_DIM and out_dim % multiple == 0 and in_dim % multiple == 0

    return convert


def float8_config(recipe: str, emulate: bool, fsdp_all_gather: bool):
    """torchao's ``Float8LinearConfig`` for ``tensorwise`` or ``rowwise`` (fp8 all-gather: tensorwise only)."""
    from torchao.float8 import Float8LinearConfig

    base = Float8LinearConfig.from_recipe_name(recipe)
    all_gather = fsdp_all_gather and recipe == "tensorwise"
    return dataclasses.replace(base, emulate=emulate, enable_fsdp_float8_all_gather=all_gather)


def mxfp8_config(emulate: bool):
    """torchao's ``MXFP8TrainingOpConfig`` (RCEIL scales; the PyTorch emulation off Blackwell GPUs)."""
    from torchao.prototype.moe_training.config import (
        MXFP8TrainingOpConfig,
        MXFP8TrainingRecipe,
    )

    recipe = MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL if emulate else MXFP8TrainingRecipe.MXFP8_RCEIL
    return MXFP8TrainingOpConfig.from_recipe(recipe)


def convert_float8(model: nn.Module, recipe: str, device_type: str, fsdp_all_gather: bool) -> list[str]:
    """Swap the chosen linears for torchao ``Float8Linear`` (tensorwise/rowwise); their names."""
    import_torchao()
    from torchao.float8 import convert_to_float8_training

    keep = fp8_filter(recipe)
    names = [fqn for fqn, mod in model.named_modules() if keep(mod, fqn)]
    config = float8_config(recipe, emulate=device_type != "cuda", fsdp_all_gather=fsdp_all_gather)
    convert_to_float8_training(model, module_filter_fn=keep, config=config)
    return names


def convert_mxfp8(model: nn.Module, device_type: str) -> list[str]:
    """Wrap the chosen linears' weights in torchao's MXFP8 training tensor; their names."""
    import_torchao()
    from torchao.quantization import quantize_

    keep = fp8_filter("mxfp8")
    names = [fqn for fqn, mod in model.named_modules() if keep(mod, fqn)]
    quantize_(model, mxfp8_config(emulate=device_type != "cuda"), filter_fn=keep)
    for name in names:
        model.get_submodule(name).register_forward_pre_hook(_input_to_weight_dtype)
    return names


def _input_to_weight_dtype(module: nn.Module, args: tuple) -> tuple:
    """Under autocast the MXFP8 wrapper sees a bf16 input beside its fp32 weight (its function runs before
    autocast's cast) and its emulated GEMM needs one dtype: the input goes to the weight's; the fp8 casts
    of both are what sets the precision."""
    x = args[0]
    return args if x.dtype == module.weight.dtype else (x.to(module.weight.dtype), *args[1:])
