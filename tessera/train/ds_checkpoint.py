"""Reading DeepSpeed's own checkpoints (ZeRO-1/2/3 and universal) without unpickling arbitrary objects.

DeepSpeed writes pickles with ``torch.save``. Every file here is read with ``weights_only=True``;
the optimizer files also hold a few DeepSpeed objects (the ZeRO stage enum, the loss scaler,
fragment addresses), which are allowed by name for that one read and nothing else is.

A ZeRO checkpoint (``global_stepN/``) holds per-rank flat fp32 partitions of each parameter
group and the Adam moments in the same layout; the full tensors are put back together as
DeepSpeed's ``zero_to_fp32`` does: concatenated per group for ZeRO-1/2 (walking the parameter
shapes), zipped per parameter for ZeRO-3 (each rank holds ``ceil(numel / world)`` of each). A
universal checkpoint (``ds_to_universal`` output) already has one folder per parameter.
"""

from __future__ import annotations

import math
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tessera.train.checkpoint import CheckpointError

MOMENTS = ("exp_avg", "exp_avg_sq")
_OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


@dataclass
class DeepSpeedState:
    """The full (unpartitioned) fp32 state of a DeepSpeed checkpoint, by DeepSpeed's parameter names."""

    weights: dict[str, torch.Tensor]  # trainable parameters, tied copies and buffers
    moments: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # Adam moments per trainable parameter
    step: int = 0  # optimizer steps taken
    global_steps: int = 0  # DeepSpeed's step counter (the checkpoint's step)
    kind: str = ""  # "zero-1", "zero-2", "zero-3" or "universal"


def _allowed_classes() -> list[Any]:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


def safe_load(path: Path) -> Any:
    """``torch.load(weights_only=True)`` of one DeepSpeed file, allowing only DeepSpeed's checkpoint classes."""
    try:
        with torch.serialization.safe_globals(_allowed_classes()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, EOFError, RuntimeError) as err:
        raise CheckpointError(f"cannot read DeepSpeed file '{path}': {str(err).splitlines()[0]}") from None
    except pickle.UnpicklingError as err:  # the weights-only unpickler refused a class
        raise CheckpointError(
            f"'{path}' holds objects tessera does not unpickle ({str(err).splitlines()[0][:200]}); "
            "convert it with DeepSpeed's ds_to_universal first"
        ) from None


def find_deepspeed_checkpoint(path: str | Path) -> Path:
    """The folder holding the checkpoint files: ``path`` itself, or the tag its ``latest`` file names."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"'{path}' is not a directory; give a DeepSpeed checkpoint folder (global_stepN)")
    if (path / "zero").is_dir() or any(path.glob("*model_states.pt")):
        return path
    for name in ("latest_universal", "latest"):
        if (path / name).is_file():
            return find_deepspeed_checkpoint(path / _tag(path / name))
    raise CheckpointError(
        f"'{path}' holds no DeepSpeed checkpoint (no *model_states.pt, zero/ folder or 'latest' file)"
    )


def _tag(latest: Path) -> str:
    """The checkpoint folder a ``latest`` file names: one sub-folder's name (a torn write leaves it empty)."""
    try:
        tag = latest.read_bytes().decode("utf-8").strip()
    except UnicodeDecodeError:
        tag = ""
    if not tag or "/" in tag or tag in (".", "..") or not (latest.parent / tag).is_dir():
        raise CheckpointError(
            f"'{latest}' does not name a checkpoint folder beside it (got {tag[:80]!r}; a torn write?); "
            "give the global_stepN folder itself"
        )
    return tag


def read_deepspeed(path: str | Path) -> DeepSpeedState:
    """The full state of a DeepSpeed ZeRO or universal checkpoint folder (or its parent with ``latest``)."""
    folder = find_deepspeed_checkpoint(path)
    try:
        return _read_universal(folder) if (folder / "zero").is_dir() else _read_zero(folder)
    except CheckpointError:
        raise
    except (KeyError, IndexError, TypeError, AttributeError, ValueError, StopIteration) as err:
        # The files unpickled (weights only) but are not laid out as DeepSpeed writes them.
        raise CheckpointError(
            f"'{folder}' does not hold DeepSpeed's checkpoint layout ({type(err).__name__}: {str(err)[:120]}); "
            "give a folder DeepSpeed's save_checkpoint wrote"
        ) from None


def _model_states(folder: Path) -> dict[str, Any] | None:
    files = sorted(folder.glob("*model_states.pt"))
    return safe_load(files[0]) if files else None


def _optim_files(folder: Path) -> list[Path]:
    found = {}
    for file in folder.iterdir():
        match = _OPTIM_FILE.match(file.name)
        if match:
            if int(match.group(2)) != 0:
                raise CheckpointError(
                    f"'{folder}' was saved with model (tensor) parallelism; tessera imports data-parallel ZeRO "
                    "checkpoints only"
                )
            found[int(match.group(1))] = file
    if not found or sorted(found) != list(range(len(found))):
        raise CheckpointError(f"'{folder}' lacks ZeRO optimizer files zero_pp_rank_*_mp_rank_00_optim_states.pt")
    return [found[r] for r in range(len(found))]


def _read_zero(folder: Path) -> DeepSpeedState:
    states = _model_states(folder)
    ranks = [safe_load(f)["optimizer_state_dict"] for f in _optim_files(folder)]
    stage = int(ranks[0]["zero_stage"])
    shapes: list[dict[str, torch.Size]] = states["param_shapes"]
    if states.get("frozen_param_shapes"):
        raise CheckpointError(f"'{folder}' has frozen parameters; tessera imports checkpoints that train every weight")
    if stage <= 2:
        flats = [r["single_partition_of_fp32_groups"] for r in ranks]
        opt = [r["base_optimizer_state"]["state"] for r in ranks]
        merge = _merge_zero12
        paddings = ranks[0].get("param_alignment_paddings")
    else:
        flats = [r["fp32_flat_groups"] for r in ranks]
        opt = [r["optimizer_state_dict"]["state"] for r in ranks]
        merge, paddings = _merge_zero3, None
    result = DeepSpeedState(merge(shapes, flats, paddings), kind=f"zero-{stage}")
    if opt[0]:
        groups = sorted(opt[0])
        per_moment = {m: merge(shapes, [[o[g][m] for g in groups] for o in opt], paddings) for m in MOMENTS}
        result.moments = {name: {m: per_moment[m][name] for m in MOMENTS} for name in result.weights}
        result.step = int(opt[0][groups[0]]["step"])
    _add_buffers_and_shared(result, states)
    return result


def _merge_zero12(
    shapes: list[dict[str, torch.Size]], flats: list[list[torch.Tensor]], paddings: list[list[int]] | None
) -> dict[str, torch.Tensor]:
    """ZeRO-1/2: each group's flat vector is split evenly over the ranks; parameters lie in it in order."""
    out = {}
    for g, group in enumerate(shapes):
        full = torch.cat([rank[g].float() for rank in flats])
        offset = 0
        for i, (name, shape) in enumerate(group.items()):
            numel = math.prod(shape)
            out[name] = full.narrow(0, offset, numel).view(shape).clone()
            offset += numel + (paddings[g][i] if paddings else 0)
    return out


def _merge_zero3(
    shapes: list[dict[str, torch.Size]], flats: list[list[torch.Tensor]], paddings: None = None
) -> dict[str, torch.Tensor]:
    """ZeRO-3: every rank holds ``ceil(numel / world)`` elements of every parameter, one after another."""
    world = len(flats)
    per_rank = [torch.cat([t.float() for t in rank]) for rank in flats]
    out, offset = {}, 0
    for name, shape in ((n, s) for group in shapes for n, s in group.items()):
        numel = math.prod(shape)
        part = math.ceil(numel / world)
        full = torch.cat([flat.narrow(0, offset, part) for flat in per_rank])
        out[name] = full[:numel].view(shape).clone()
        offset += part
    return out


def _add_buffers_and_shared(result: DeepSpeedState, states: dict[str, Any] | None) -> None:
    if states is None:
        return
    module = states.get("module") or {}
    for name in states.get("buffer_names") or []:
        if name in module:
            result.weights[name] = module[name].float()
    for name, source in (states.get("shared_params") or {}).items():
        result.weights[name] = result.weights[source]
    result.global_steps = int(states.get("global_steps", result.step))


def _tensor(value: Any) -> torch.Tensor:
    return (value["param"] if isinstance(value, dict) else value).float()


def _read_universal(folder: Path) -> DeepSpeedState:
    zero = folder / "zero"
    result = DeepSpeedState({}, kind="universal")
    for param_dir in sorted(p for p in zero.iterdir() if p.is_dir()):
        if not (param_dir / "fp32.pt").is_file():
            raise CheckpointError(f"universal checkpoint folder '{param_dir}' lacks fp32.pt")
        result.weights[param_dir.name] = _tensor(safe_load(param_dir / "fp32.pt"))
        if all((param_dir / f"{m}.pt").is_file() for m in MOMENTS):
            result.moments[param_dir.name] = {m: _tensor(safe_load(param_dir / f"{m}.pt")) for m in MOMENTS}
        if (param_dir / "step.pt").is_file() and not result.step:
            result.step = int(_tensor(safe_load(param_dir / "step.pt")).item())
    if not result.step and (zero / "optimizer_state.pt").is_file():
        state = safe_load(zero / "optimizer_state.pt")["optimizer_state_dict"]["state"]
        result.step = int(next(iter(state.values()))["step"]) if state else 0
    result.global_steps = result.step
    _add_buffers_and_shared(result, _model_states(folder))
    return result
