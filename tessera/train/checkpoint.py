"""Checkpoints with torch.distributed.checkpoint (DCP): atomic, keep-last-k, safe to load.

A checkpoint is a directory ``checkpoints/step_XXXXXXXX`` holding DCP shards of every tensor
(model, optimizer state, RNG states) and ``meta.json`` with the rest as plain JSON (step,
scheduler, data-loader position, optimizer hyper-parameters, config). It is written under a
``.tmp`` name and renamed when complete, so a crash mid-save leaves the previous checkpoint as
the newest complete one. Loading never unpickles arbitrary objects: tensors are read with
``weights_only``, DCP's metadata file goes through an allow-list unpickler, and a checkpoint
that declares anything tessera never writes (a pickled "bytes" entry, a shard file outside its
directory, a stream transform) is refused before a byte of it is read.
"""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from tessera.errors import CheckpointError

CHECKPOINT_DIR = "checkpoints"
_STEP_DIR = re.compile(r"^step_(\d{8})$")
META = "meta.json"


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and nothing else (no arbitrary classes or callables)."""

    _MODULES = ("torch.distributed.checkpoint.",)
    _ALLOWED = {
        ("torch", "Size"),
        ("collections", "OrderedDict"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "slice"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(self._MODULES) or (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which tessera does not load")


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader with an allow-list unpickler for the ``.metadata`` file.

    It also refuses metadata that declares what tessera never writes: entries stored as pickled
    bytes (DCP's default planner would ``torch.load(weights_only=False)`` them, i.e. run code),
    shard files outside the checkpoint directory, and stream transforms.
    """

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        _check_entries(metadata, Path(str(path)))
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _check_entries(metadata: Any, path: Path) -> None:
    """Raise unless every entry of DCP ``metadata`` is a tensor in a plain shard file beside ``path``."""
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"'{path}' holds a {type(metadata).__name__}, not DCP metadata; it is not a checkpoint")
    for fqn, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(
                f"checkpoint metadata '{path}' declares '{fqn}' as {type(entry).__name__}; tessera writes only "
                "tensors and refuses to load it (the checkpoint was not written by tessera or was tampered with)"
            )
    for index, info in metadata.storage_data.items():
        name = str(getattr(info, "relative_path", ""))
        if not name or Path(name).name != name or name in (".", "..") or getattr(info, "transform_descriptors", None):
            raise CheckpointError(
                f"checkpoint metadata '{path}' stores '{index.fqn}' in {name!r}"
                f"{' with transforms' if getattr(info, 'transform_descriptors', None) else ''}; tessera reads only "
                "plain shard files inside the checkpoint directory and refuses to load it"
            )


class _WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that a bytes entry is read with ``weights_only=True``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _to_json(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_to_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_json(v) for k, v in value.items()}
    return value


def _param_groups_from_json(groups: list[dict]) -> list[dict]:
    return [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in groups]


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / META).is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run, or None."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def read_meta(path: str | Path, required: tuple[str, ...] = ("step", "config")) -> dict[str, Any]:
    """The JSON part of a checkpoint (step, config, loader and scheduler state); ``required`` keys must be there."""
    meta = Path(path) / META
    if not meta.is_file():
        raise CheckpointError(
            f"'{path}' is not a complete tessera checkpoint (no {META}); pick a directory under "
            f"<run_dir>/{CHECKPOINT_DIR}/"
        )
    try:
        data = json.loads(meta.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"'{meta}' is corrupt ({err}); resume from an older checkpoint") from None
    if not isinstance(data, dict):
        raise CheckpointError(
            f"'{meta}' is corrupt (a JSON {type(data).__name__}, not an object); resume from an older checkpoint"
        )
    missing = [key for key in required if key not in data]
    if missing:
        raise CheckpointError(
            f"'{meta}' is incomplete (no {', '.join(repr(k) for k in missing)}); resume from an older checkpoint"
        )
    if not isinstance(data.get("step", 0), int) or not isinstance(data.get("config", {}), dict):
        raise CheckpointError(f"'{meta}' is corrupt (a malformed 'step' or 'config'); resume from an older checkpoint")
    return data


class Checkpointer:
    """Saves and restores the full training state of a run directory."""

    def __init__(self, run_dir: str | Path, keep_last: int, is_main: bool = True) -> None:
        self.root = Path(run_dir) / CHECKPOINT_DIR
        self.keep_last = keep_last
        self.is_main = is_main

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any]) -> Path:
        """Write step ``step`` atomically, then drop all but the newest ``keep_last``.

        Collective under torch.distributed: every rank writes its shards into one ``.tmp``
        directory; rank 0 then writes ``meta.json`` and renames it. A failed write (a full disk)
        removes the ``.tmp`` and leaves the previous checkpoint the newest.
        """
        model_sd, optim_sd = get_state_dict(model, optimizer)
        return self.save_state(step, model_sd, optim_sd["state"], optim_sd["param_groups"], extra)

    def save_state(
        self,
        step: int,
        model_state: dict[str, Any],
        optim_state: dict[str, Any],
        param_groups: list[dict[str, Any]],
        extra: dict[str, Any],
    ) -> Path:
        """:meth:`save` of state dicts in DCP's naming (an engine that is not a torch optimizer builds them).

        A rank may hold only some keys (each key's full value on one rank, or shards on several).
        """
        final = self.root / f"step_{step:08d}"
        tmp = self.root / f"step_{step:08d}.tmp"
        if self.is_main:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        _barrier()
        tensors = {"model": model_state, "optim": optim_state, "rng": _rng_state()}
        param_groups = _gather_param_groups(_to_json(param_groups))
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(tmp)))
            if self.is_main:
                meta = dict(extra, step=step, optim_param_groups=param_groups)
                (tmp / META).write_text(json.dumps(meta, indent=1), encoding="utf-8")
        except (CheckpointException, OSError, RuntimeError) as err:
            if self.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            needed, free = _local_bytes(tensors), shutil.disk_usage(self.root).free
            if not _out_of_space(err) and needed <= free:
                raise
            newest = latest_checkpoint(self.root.parent)
            raise CheckpointError(
                f"no space left on the device of '{self.root}' while writing checkpoint step {step} (this rank's "
                f"shards need about {needed / 2**20:.1f} MiB, {free / 2**20:.1f} MiB are free); removed the partial "
                f"'{tmp.name}', the newest complete checkpoint is {newest.name if newest else 'none'}; free space or "
                "move train.run_dir"
            ) from None
        if self.is_main:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            self._prune()
        _barrier()
        return final

    def wait(self) -> Path | None:
        """Nothing to wait for: a synchronous save is complete when ``save`` returns (see AsyncCheckpointer)."""
        return None

    def _prune(self) -> None:
        for old in list_checkpoints(self.root.parent)[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    def load(
        self,
        path: str | Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        restore_rng: bool = True,
    ) -> dict[str, Any]:
        """Restore model (and optimizer, RNG) from ``path``; returns the checkpoint's JSON part."""
        meta = read_meta(path)
        model_sd, optim_sd = (
            get_state_dict(model, optimizer) if optimizer is not None else (get_model_state(model), None)
        )
        tensors: dict[str, Any] = {"model": model_sd, "rng": _rng_state()}
        if optim_sd is not None:
            tensors["optim"] = optim_sd["state"]
        load_tensors(path, tensors)
        if optim_sd is not None:
            full = {"state": tensors["optim"], "param_groups": _param_groups_from_json(meta["optim_param_groups"])}
            set_state_dict(model, optimizer, model_state_dict=tensors["model"], optim_state_dict=full)
        else:
            model.load_state_dict(tensors["model"])
        if restore_rng:
            _set_rng_state(tensors["rng"])
        return meta


def load_tensors(path: str | Path, tensors: dict[str, Any], no_dist: bool = False) -> None:
    """Fill ``tensors`` (any subset of a checkpoint's keys, shaped as wanted) in place from checkpoint ``path``
    (``no_dist``: this rank alone, without the load's collectives)."""
    reader = SafeFileSystemReader(str(path))
    try:
        reader.read_metadata()
    except (OSError, EOFError, pickle.UnpicklingError) as err:
        raise CheckpointError(
            f"checkpoint '{path}' has unreadable DCP metadata ({err}); resume from another checkpoint"
        ) from None
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(tensors, storage_reader=reader, planner=_WeightsOnlyLoadPlanner(), no_dist=no_dist)
    except (CheckpointException, RuntimeError, ValueError, KeyError, pickle.UnpicklingError) as err:
        raise CheckpointError(
            f"checkpoint '{path}' does not fit this model or is damaged: {_first_failure(err)}"
        ) from None


def load_rng_state(path: str | Path) -> None:
    """Set this process's RNG states to those saved in checkpoint ``path``."""
    tensors = {"rng": _rng_state()}
    load_tensors(path, tensors)
    _set_rng_state(tensors["rng"])


def _gather_param_groups(groups: list[dict]) -> list[dict]:
    """The optimizer's parameter groups with every rank's parameter names.

    Under pipeline parallelism each rank's optimizer holds only its stages' parameters; the
    checkpoint lists all of them so any layout (e.g. one process) can load it.
    """
    if not torch.distributed.is_initialized():
        return groups
    everyone: list[list[dict]] = [[] for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather_object(everyone, groups)
    merged = [dict(g, params=list(g["params"])) for g in groups]
    for group, *theirs in zip(merged, *everyone):
        seen = set(group["params"])
        for fqn in (fqn for other in theirs for fqn in other["params"]):
            if fqn not in seen:
                seen.add(fqn)
                group["params"].append(fqn)
    return merged


def _local_bytes(tree: Any) -> int:
    """Bytes of this rank's part of every tensor in ``tree`` (what its checkpoint shards hold)."""
    if isinstance(tree, DTensor):
        tree = tree.to_local()
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_local_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_local_bytes(v) for v in tree)
    return 0


def _first_failure(err: BaseException) -> str:
    """The first line of what went wrong (for DCP's wrapper: of the first rank's own exception)."""
    if isinstance(err, CheckpointException) and err.failures:
        failure = next(iter(err.failures.values()))
        err = failure[0] if isinstance(failure, tuple) else failure
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


def _out_of_space(err: BaseException) -> bool:
    """Whether ``err`` (or a rank's failure DCP wrapped in it) is an out-of-space or over-quota error."""
    causes: list[BaseException] = [err]
    if isinstance(err, CheckpointException):
        causes += [failure[0] if isinstance(failure, tuple) else failure for failure in err.failures.values()]
    return any(isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in causes)


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def get_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict in DCP's naming (the same keys a training checkpoint uses)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model)
