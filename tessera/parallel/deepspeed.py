"""The DeepSpeed engine: ZeRO-1/2/3 data parallelism with CPU and NVMe offload, configured from tessera's keys.

The DeepSpeed config is generated from the job (batch, accumulation, clipping, precision, ZeRO
stage, offload); an expert's ``parallel.deepspeed.config`` ds.json is merged into it, and any key
that contradicts a generated one is refused in one line. tessera's own AdamW parameter groups
and LR schedule are DeepSpeed's client optimizer and scheduler (``DeepSpeedCPUAdam`` when the
optimizer is offloaded). Full (unpartitioned) fp32 weights and Adam moments are read and written
per parameter through DeepSpeed's ``safe_get/set_full_*`` API, so a run's checkpoints keep
tessera's DCP layout and stay interchangeable with the torch engine.

deepspeed is imported lazily: the config generation here is plain Python.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tessera.config import ConfigError, JobConfig
from tessera.errors import read_json_object
from tessera.parallel.env import export_single_process_env
from tessera.parallel.rules import DS_JSON_FIX

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")

# Generated keys -> the tessera setting they come from (named when a ds.json contradicts one).
_SOURCES = {
    "train_batch_size": "train.batch_size x train.grad_accum",
    "train_micro_batch_size_per_gpu": "train.batch_size / data-parallel ranks",
    "gradient_accumulation_steps": "train.grad_accum",
    "gradient_clipping": "optim.grad_clip",
    "zero_optimization.stage": "parallel.deepspeed.zero_stage",
    "zero_optimization.offload_optimizer.device": "parallel.deepspeed.offload_optimizer",
    "zero_optimization.offload_optimizer.nvme_path": "parallel.deepspeed.nvme_path",
    "zero_optimization.offload_param.device": "parallel.deepspeed.offload_params",
    "zero_optimization.offload_param.nvme_path": "parallel.deepspeed.nvme_path",
    "bf16.enabled": "train.dtype",
    "fp16.enabled": "train.dtype",
}
# Blocks tessera supplies itself as objects (client optimizer and scheduler from optim.*).
_CLIENT_BLOCKS = {"optimizer": "optim.* (tessera's AdamW groups)", "scheduler": "optim.schedule"}


def _offload(device: str, nvme_path: str, pin: bool) -> dict[str, Any]:
    block: dict[str, Any] = {"device": device}
    if device == "nvme":
        block["nvme_path"] = nvme_path
    if device != "none":
        block["pin_memory"] = pin
    return block


def generated_config(config: JobConfig, dp: int, device_type: str = "cpu") -> dict[str, Any]:
    """The DeepSpeed config tessera's keys define for ``dp`` data-parallel ranks."""
    p, t = config.parallel, config.train
    if t.batch_size % dp:
        raise ConfigError(
            f"train.batch_size={t.batch_size} (global) is not divisible by the {dp} data-parallel ranks; "
            f"make it a multiple of {dp}"
        )
    pin = device_type == "cuda"
    zero = {
        "stage": p.deepspeed.zero_stage,
        "offload_optimizer": _offload(p.deepspeed.offload_optimizer, p.deepspeed.nvme_path, pin),
        "offload_param": _offload(p.deepspeed.offload_params, p.deepspeed.nvme_path, pin),
    }
    return {
        "train_batch_size": t.batch_size * t.grad_accum,
        "train_micro_batch_size_per_gpu": t.batch_size // dp,
        "gradient_accumulation_steps": t.grad_accum,
        "gradient_clipping": config.optim.grad_clip,  # 0 disables, as in tessera
        "zero_optimization": zero,
        "bf16": {"enabled": t.dtype == "bf16"},
        "fp16": {"enabled": t.dtype == "fp16"},  # DeepSpeed's dynamic loss scaler replaces torch's GradScaler
        "steps_per_print": 2**31 - 1,  # tessera logs every step itself
        "wall_clock_breakdown": False,
    }


def _merge(ours: dict[str, Any], theirs: dict[str, Any], where: str, prefix: str = "") -> dict[str, Any]:
    merged = dict(ours)
    for key, value in theirs.items():
        dotted = f"{prefix}{key}"
        if dotted in _CLIENT_BLOCKS:
            raise ConfigError(
                f"{where} sets '{dotted}', but tessera passes its own from {_CLIENT_BLOCKS[dotted]}; remove it from "
                "the ds.json"
            )
        if isinstance(ours.get(key), dict) and not isinstance(value, dict):
            raise ConfigError(
                f"{where} sets {dotted}={json.dumps(value)}, but DeepSpeed expects a block there, e.g. "
                f'"{key}": {json.dumps(ours[key])}'
            )
        if isinstance(value, dict) and isinstance(ours.get(key), dict):
            merged[key] = _merge(ours[key], value, where, f"{dotted}.")
        elif dotted in _SOURCES and value != ours.get(key):
            raise ConfigError(
                f"{where} sets {dotted}={json.dumps(value)} but {_SOURCES[dotted]} gives {json.dumps(ours.get(key))}; "
                "change the tessera setting or remove the key from the ds.json"
            )
        else:
            merged[key] = value
    return merged


def deepspeed_config(config: JobConfig, dp: int, device_type: str = "cpu") -> dict[str, Any]:
    """:func:`generated_config` with ``parallel.deepspeed.config`` merged in (contradictions refused)."""
    ours = generated_config(config, dp, device_type)
    path = config.parallel.deepspeed.config
    if not path:
        return ours
    return _merge(ours, read_user_json(path), f"parallel.deepspeed.config='{path}'")


def read_user_json(path: str | Path) -> dict[str, Any]:
    """The JSON object of a ds.json, or one ConfigError naming ``parallel.deepspeed.config`` and the problem."""
    return read_json_object(path, ConfigError, f"parallel.deepspeed.config='{path}'", DS_JSON_FIX)


class _ReadKeys(dict):
    """A dict that remembers which keys were asked for: DeepSpeed's parser reads every key it knows."""

    def __init__(self, data: dict[str, Any]) -> None:
        super().__init__(data)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self.read.add(str(key))
        return super().__contains__(key)


def check_with_deepspeed(config: JobConfig, ds_config: dict[str, Any]) -> None:
    """Run DeepSpeed's own config parser over the merged config of a user ds.json (a process group exists):
    what it rejects, and any top-level key it never reads (a misspelling DeepSpeed would silently ignore),
    is one ConfigError naming the key."""
    if not config.parallel.deepspeed.config:
        return
    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
    from pydantic import ValidationError

    where = f"parallel.deepspeed.config='{config.parallel.deepspeed.config}'"
    probe = _ReadKeys(ds_config)
    try:
        DeepSpeedConfig(probe)
    except ValidationError as err:
        first = err.errors()[0]
        key = ".".join(map(str, first["loc"]))
        raise ConfigError(f"{where}: DeepSpeed's {err.title} refuses '{key}' ({first['msg']})") from None
    except (DeepSpeedConfigError, ValueError, TypeError, KeyError) as err:
        raise ConfigError(f"{where}: DeepSpeed refuses it ({str(err).strip().splitlines()[0][:200]})") from None
    unread = sorted(set(ds_config) - probe.read)
    if unread:
        close = difflib.get_close_matches(unread[0], sorted(probe.read), n=1)
        guess = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"{where}: DeepSpeed has no key '{unread[0]}'{guess}; it would be ignored, fix or remove it")


def cpu_adam(groups: list[dict[str, Any]], lr: float, betas: tuple[float, float], eps: float) -> torch.optim.Optimizer:
    """DeepSpeed's vectorized CPU AdamW over tessera's parameter groups (the offloaded optimizer)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(groups, lr=lr, betas=betas, eps=eps, adamw_mode=True)


def ensure_process_group(device_type: str) -> None:
    """A one-process group when none exists (DeepSpeed always needs one; torchrun sets up larger ones)."""
    if not dist.is_initialized():
        export_single_process_env()
        dist.init_process_group(
            "nccl" if device_type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1
        )


def initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    ds_config: dict[str, Any],
) -> Any:
    """``deepspeed.initialize`` with tessera's client optimizer and scheduler; returns the engine."""
    import deepspeed

    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
    return engine


def parameter_names(module: nn.Module) -> dict[int, str]:
    """id(parameter) -> its first name in ``module`` (the name DCP's optimizer state uses)."""
    from tessera.parallel.checksum import canonical_name

    names: dict[int, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), canonical_name(name))
    return names


def state_keys(module: nn.Module) -> list[str]:
    """The keys of ``module.state_dict()`` by canonical name (read before DeepSpeed partitions the module)."""
    from tessera.parallel.checksum import canonical_name

    return [canonical_name(key) for key in module.state_dict()]


def state_entries(module: nn.Module, keys: list[str]) -> Iterator[tuple[str, nn.Parameter | None, torch.Tensor | None]]:
    """(state-dict key, its parameter or None, its buffer or None) for each of ``keys``."""
    from tessera.parallel.checksum import canonical_name

    params = {canonical_name(n): p for n, p in module.named_parameters(remove_duplicate=False)}
    buffers = {canonical_name(n): b for n, b in module.named_buffers(remove_duplicate=False)}
    for key in keys:
        yield key, params.get(key), buffers.get(key)


def _inner(engine: Any) -> torch.optim.Optimizer:
    return engine.optimizer.optimizer  # the client optimizer inside DeepSpeed's ZeRO optimizer


def optimizer_step_count(engine: Any) -> int:
    """Optimizer steps taken so far (0 before the first)."""
    for state in _inner(engine).state.values():
        if "step" in state:
            return int(state["step"])
    return 0


def full_shape(param: nn.Parameter) -> torch.Size:
    """The unpartitioned shape of ``param`` (ZeRO-3 leaves an empty placeholder in the module)."""
    return param.ds_shape if _is_z3(param) else param.shape


def full_weight(param: nn.Parameter) -> torch.Tensor:
    """The full fp32 master weight of ``param`` on the CPU (collective over the data-parallel ranks)."""
    from deepspeed.utils import safe_get_full_fp32_param

    return safe_get_full_fp32_param(param).detach().float().cpu().reshape(full_shape(param))


def full_moments(engine: Any, param: nn.Parameter) -> dict[str, torch.Tensor]:
    """The full Adam moments of ``param`` on the CPU (zeros before the first step; collective)."""
    from deepspeed.utils import safe_get_full_optimizer_state

    shape = full_shape(param)
    if optimizer_step_count(engine) == 0:
        return {key: torch.zeros(shape) for key in ADAM_MOMENTS}
    return {
        key: safe_get_full_optimizer_state(param, key).detach().float().cpu().reshape(shape) for key in ADAM_MOMENTS
    }


def link_optimizer_state(engine: Any) -> None:
    """Point every ZeRO-1/2 parameter's fragment at its Adam state (read before :func:`full_moments`).

    DeepSpeed links them after the first group's first step, before a later group (with CPU
    offload, stepped one at a time) has state, leaving that group's fragments without moments.
    """
    zero = engine.optimizer
    if hasattr(zero, "_lazy_init_hp_params_optimizer_state") and _inner(engine).state:
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()


def _is_z3(param: nn.Parameter) -> bool:
    return hasattr(param, "ds_id")


def create_optimizer_state(engine: Any, step: int) -> None:
    """Zero Adam state at ``step`` for every partition, so full moments can be written into a fresh engine."""
    inner, zero = _inner(engine), engine.optimizer
    # The optimizer steps flat fp32 partitions: one per subgroup (ZeRO-3) or per parameter group (ZeRO-1/2).
    flats = getattr(zero, "fp32_partitioned_groups_flat", None) or zero.single_partition_of_fp32_groups
    for flat in flats:
        count = torch.tensor(float(step)) if isinstance(inner, torch.optim.Adam) else step
        inner.state[flat] = {"step": count, **{key: torch.zeros_like(flat) for key in ADAM_MOMENTS}}
    link_optimizer_state(engine)


def set_full(param: nn.Parameter, weight: torch.Tensor, moments: dict[str, torch.Tensor] | None) -> None:
    """Write a full fp32 weight (and Adam moments) into ``param``'s partitions on every rank."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    device = param.device
    safe_set_full_fp32_param(param, weight.to(device))
    for key, value in (moments or {}).items():
        safe_set_full_optimizer_state(param, value.to(device), key)
    if not _is_z3(param):  # ZeRO-1/2 keep a full working copy of each weight on every rank
        with torch.no_grad():
            param.data.copy_(weight.to(param.dtype).reshape(param.shape))


def finish_loading(engine: Any) -> None:
    """After :func:`set_full`: refresh ZeRO-3's working partitions (and persistent parameters) from the masters."""
    zero = engine.optimizer
    if not hasattr(zero, "fp32_partitioned_groups_flat"):
        return  # ZeRO-1/2: set_full copied each working weight
    for i in range(len(zero.fp32_partitioned_groups_flat)):
        zero._reassign_or_swap_out_partitioned_parameters(i)  # DeepSpeed's own post-step refresh (or NVMe swap-out)
    if zero.persistent_parameters:
        zero.persistent_parameters[0].all_gather(zero.persistent_parameters)
