"""Asynchronous checkpoints (``checkpoint.async = true``): training goes on while the last checkpoint is written.

Same files as :class:`~tessera.train.checkpoint.Checkpointer` (every rank's DCP shards in
``step_XXXXXXXX.tmp``, then rank 0 writes ``meta.json`` and renames), in a different order:

1. wait for the save in flight, if any (at most one: its staging buffers are reused);
2. collectively: rank 0 makes the ``.tmp`` directory, every rank takes its state dict and the
   optimizer's parameter groups are gathered; the JSON part is serialized now, so it describes
   this step whatever the loop does next;
3. ``dcp.async_save`` returns at once; a staging thread copies every tensor into CPU memory
   (kept between saves; pinned on CUDA) while the next step's forward and backward run. Only
   the optimizer changes the saved tensors in place, so an optimizer pre-step hook waits for
   that copy: the next ``optimizer.step()`` is the one point training can stall. A writer thread
   then writes the copy, coordinating the ranks over a gloo group of its own, never the
   training's group, whose collectives run at the same time;
4. when the write completed on rank 0 (DCP's final gather means every rank's shards are on
   disk), rank 0 writes ``meta.json``, renames the directory and prunes to ``keep_last``.

A crash before 4 leaves a ``.tmp`` directory without ``meta.json``, which
:func:`~tessera.train.checkpoint.list_checkpoints` ignores: the previous checkpoint stays the
newest. The trainer waits for the save in flight before a preemption exit and at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from tessera.train.checkpoint import (
    META,
    Checkpointer,
    CheckpointError,
    _barrier,
    _gather_param_groups,
    _local_bytes,
    _out_of_space,
    _rng_state,
    _to_json,
    latest_checkpoint,
)


class AsyncCheckpointer(Checkpointer):
    """A :class:`Checkpointer` whose ``save`` returns once the state is staged (see the module doc)."""

    def __init__(self, run_dir: str | Path, keep_last: int, is_main: bool = True) -> None:
        super().__init__(run_dir, keep_last, is_main)
        self.distributed = dist.is_available() and dist.is_initialized()
        # Collective on every rank, in the same order: the trainer builds its checkpointer on all of them.
        self.group = dist.new_group(backend="gloo") if self.distributed else None
        cuda = torch.cuda.is_available()
        self.stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=cuda
            )
        )
        self._pending: Future | None = None  # resolves to the renamed checkpoint once committed
        self._staging: Future | None = None  # the copy into staging memory, until the next optimizer step
        self._hooked: set[int] = set()
        self.stalled_seconds = 0.0  # time optimizer steps waited for staging (the loop's share of a save)
        self._pending_name = ""
        self._pending_step, self._pending_bytes = 0, 0  # what the save in flight writes (for its error message)
        self._abandoned = False  # a second Ctrl-C while waiting: the write in flight must not be committed
        self.write_seconds = 0.0  # the last save, from its start to its rename (rank 0) or end of write
        if not self.distributed:  # DCP warns on every single-process save, from the writer thread
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any]) -> Path:
        """Stage step ``step`` and start writing it in the background; returns the path it will have.

        Collective under torch.distributed. Waits first for the previous save (at most one in flight).
        """
        self.wait()
        started = time.perf_counter()
        final, tmp = self.root / f"step_{step:08d}", self.root / f"step_{step:08d}.tmp"
        if self.is_main:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        _barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        tensors = {"model": model_sd, "optim": optim_sd["state"], "rng": _rng_state()}
        param_groups = _gather_param_groups(_to_json(optim_sd["param_groups"]))
        meta = json.dumps(dict(extra, step=step, optim_param_groups=param_groups), indent=1)
        response = dcp.async_save(
            tensors, storage_writer=dcp.FileSystemWriter(str(tmp)), process_group=self.group, async_stager=self.stager
        )
        written = response
        if isinstance(response, AsyncSaveResponse):
            written, self._staging = response.upload_completion, response.staging_completion
            self._guard(optimizer)
        committed: Future = Future()
        written.add_done_callback(lambda f: self._commit(f, committed, tmp, final, meta, started))
        self._pending, self._pending_name = committed, final.name
        self._pending_step, self._pending_bytes = step, _local_bytes(tensors)
        return final

    def _commit(self, written: Future, committed: Future, tmp: Path, final: Path, meta: str, started: float) -> None:
        """Runs on the writer thread once DCP finished: rank 0 writes meta.json, renames, prunes."""
        try:
            written.result()
            if self._abandoned:
                raise KeyboardInterrupt  # the user aborted while this was written: it never becomes a checkpoint
            if self.is_main:
                (tmp / META).write_text(meta)
                if final.exists():
                    shutil.rmtree(final)
                os.replace(tmp, final)
                self._prune()
                for stale in self.root.glob("step_*.tmp"):  # left by a crash mid-write: never completed
                    shutil.rmtree(stale, ignore_errors=True)
            self.write_seconds = time.perf_counter() - started
            committed.set_result(final)
        except BaseException as err:  # noqa: BLE001 - DCP's CheckpointException is a BaseException; wait() raises it
            if self.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            committed.set_exception(err)

    def _guard(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer.step()`` wait for the staging copy (registered once per optimizer)."""
        if id(optimizer) not in self._hooked:
            self._hooked.add(id(optimizer))
            optimizer.register_step_pre_hook(lambda *_: self.wait_staged())

    def wait_staged(self) -> None:
        """Block until the last save's tensors are copied to staging memory (then they may change)."""
        if self._staging is not None:
            started = time.perf_counter()
            staging, self._staging = self._staging, None
            staging.result()
            self.stalled_seconds += time.perf_counter() - started

    @property
    def in_flight(self) -> bool:
        """Whether a save is still being written."""
        return self._pending is not None and not self._pending.done()

    def wait(self) -> Path | None:
        """Block until the save in flight is written and renamed (collective); returns its path, or None."""
        if self._pending is None:
            return None
        pending, self._pending = self._pending, None
        try:
            self.wait_staged()
            path = pending.result()
        except KeyboardInterrupt:
            self._abandoned = True
            raise
        except (CheckpointException, OSError, RuntimeError) as err:
            # A full disk reaches torch.save inside DCP as "inline_container.cc: unexpected pos", without an errno.
            free = shutil.disk_usage(self.root).free
            if not _out_of_space(err) and self._pending_bytes <= free:
                raise
            newest = latest_checkpoint(self.root.parent)
            raise CheckpointError(
                f"no space left on the device of '{self.root}' while writing checkpoint step {self._pending_step} in "
                f"the background (this rank's shards need about {self._pending_bytes / 2**20:.1f} MiB, "
                f"{free / 2**20:.1f} MiB are free); removed the partial '{self._pending_name}.tmp', the newest "
                f"complete checkpoint is {newest.name if newest else 'none'}; free space or move train.run_dir"
            ) from None
        if self.group is not None:
            dist.barrier(group=self.group)  # every rank sees the renamed directory from here on
        return path

    def close(self) -> None:
        """Wait for the save in flight and free the staging memory."""
        try:
            self.wait()
        finally:
            self.stager.close()


def build_checkpointer(run_dir: str | Path, keep_last: int, is_main: bool, async_save: bool) -> Checkpointer:
    """An :class:`AsyncCheckpointer` for ``checkpoint.async = true``, else the synchronous :class:`Checkpointer`."""
    return (AsyncCheckpointer if async_save else Checkpointer)(run_dir, keep_last, is_main)
