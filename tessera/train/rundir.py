"""The run directory's integrity: one training at a time, no silent overwrite, a consistent history.

A run directory belongs to one training run. The rank that writes (rank 0) holds the run's
:class:`tessera.train.lock.RunLock` (an exclusive ``flock`` on ``RUN/run.lock``, dropped by the kernel
when the process ends, however it ends) for as long as it trains. A fresh start
(``train.resume=none``, or a checkpoint of another run) is refused where checkpoints already
exist, unless ``train.overwrite=true`` first deletes what an earlier run wrote.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tessera.config import ConfigError, JobConfig
from tessera.data.tokenizer import copy_tokenizer_files
from tessera.parallel.env import dist_env
from tessera.train.checkpoint import (
    CHECKPOINT_DIR,
    CheckpointError,
    latest_checkpoint,
    read_meta,
)
from tessera.train.lock import RunLock
from tessera.train.metrics import json_safe, read_metrics
from tessera.train.preemption import PREEMPTION_MARKER

METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
# What a training run writes into its run directory (train.overwrite deletes exactly these).
RUN_OUTPUTS = (
    CHECKPOINT_DIR,
    "hf",  # checkpoint.hf_every's exports
    METRICS,
    SUMMARY,
    "config.toml",
    "tokenizer.model",
    "tensorboard",
    "loss_curve.png",
    "hang",
    PREEMPTION_MARKER,
)
# Keys a resumed run cannot change: the saved data position only means something for the same samples.
FIXED_ON_RESUME = {"train.seq_len": "the sequence length", "train.seed": "the data order"}
NOT_COMPARED = ("train.run_dir", "train.resume", "train.overwrite", "train.init_from", "train.upcycle_noise")


def carry_run_files(source_dir: str | Path, out_dir: str | Path) -> list[Path]:
    """Copy what a run derived from ``source_dir`` (a run or an HF directory) needs of it besides weights and
    config, so ``generate``, ``hf-export`` and ``train`` work on the new run: every tokenizer file
    (SentencePiece, HF fast tokenizer and its configs). Every derived-run writer calls this one function."""
    return copy_tokenizer_files(source_dir, out_dir)


def make_run_dir(run_dir: Path) -> None:
    """Create ``train.run_dir`` or fail in one line naming it."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"train.run_dir '{run_dir}' is a file, not a directory; choose another train.run_dir")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(
            f"train.run_dir '{run_dir}' cannot be created ({err.strerror}); choose a writable train.run_dir"
        ) from None


def open_run(config: JobConfig, is_main: bool) -> RunLock | None:
    """Prepare ``train.run_dir`` for training: create it; on the main rank lock it and refuse a silent overwrite."""
    run_dir = Path(config.train.run_dir)
    make_run_dir(run_dir)
    if not is_main:
        return None
    lock = RunLock(run_dir).acquire()  # joins the claim ``tessera train`` took before building anything
    try:
        if config.train.overwrite:
            _check_overwrite(config, run_dir)
            remove_run_outputs(run_dir)
        else:
            refuse_fresh_start_over_checkpoints(config, run_dir)
        for partial in (run_dir / CHECKPOINT_DIR).glob("step_*.tmp"):  # left by a run that died mid-save
            shutil.rmtree(partial, ignore_errors=True)
    except BaseException:
        lock.release()
        raise
    return lock


def _inside(path: Path, run_dir: Path) -> bool:
    return run_dir.resolve() in path.resolve().parents


def _check_overwrite(config: JobConfig, run_dir: Path) -> None:
    resume = config.train.resume
    if resume not in ("auto", "none") and _inside(Path(resume), run_dir):
        raise ConfigError(
            f"train.overwrite=true would delete train.resume='{resume}' before resuming from it; drop one of the two"
        )


def refuse_fresh_start_over_checkpoints(config: JobConfig, run_dir: Path) -> None:
    """A run that would not continue the checkpoints already in ``run_dir`` must not mix with them."""
    newest = latest_checkpoint(run_dir)
    resume = config.train.resume
    if newest is None or resume == "auto" or _inside(Path(resume), run_dir):
        return
    what = "train.resume=none starts fresh" if resume == "none" else f"train.resume='{resume}' is another run's"
    raise ConfigError(
        f"{what} but train.run_dir '{run_dir}' already holds checkpoints up to {newest.name}; training there would "
        "mix two runs. Resume it with train.resume=auto, use a new train.run_dir, or set train.overwrite=true to "
        "delete the old run first"
    )


def remove_run_outputs(run_dir: Path) -> None:
    """Delete what an earlier training wrote into ``run_dir`` (nothing else)."""
    for name in RUN_OUTPUTS:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def resolved_config_text(config: JobConfig) -> str:
    """The TOML written to ``RUN/config.toml``: the resolved config, with ``train.overwrite`` reset.

    Re-running a run's own config.toml must continue it, never delete it.
    """
    config = copy.deepcopy(config)
    config.train.overwrite = False
    return config.to_toml()


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``path`` so that a crash leaves the old file or the new one, never half of one."""
    tmp = path.with_name(f"{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def truncate_metrics(run_dir: Path, step: int) -> None:
    """Keep the metrics.jsonl records up to ``step`` (drop those of a run that died after its last checkpoint).

    A line torn by a crash mid-write is dropped; the file is replaced atomically.
    """
    path = run_dir / METRICS
    if not path.is_file():
        return
    keep = [r for r in read_metrics(run_dir) if isinstance(r["step"], int) and r["step"] <= step] if step > 0 else []
    write_text_atomic(path, "".join(json.dumps(json_safe(r)) + "\n" for r in keep))


def write_summary(
    run_dir: Path,
    steps: int,
    seconds: float,
    final_loss: float | None,
    continued: bool,
    param_sumsq: Any = None,
    init_from: str = "",
    extra: dict[str, Any] | None = None,
) -> None:
    """Write summary.json; a run that continued an earlier one adds to its summary instead of replacing it.

    ``extra``: more keys (spike rollbacks, goodput); a list continues the earlier session's list."""
    path = run_dir / SUMMARY
    previous: dict[str, Any] = {}
    if continued and path.is_file():
        try:
            previous = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError):
            previous = {}
    val_losses = {str(k): v for k, v in (previous.get("val_losses") or {}).items()}
    val_losses.update({str(r["step"]): r["val_loss"] for r in read_metrics(run_dir) if "val_loss" in r})
    summary = {
        "steps": steps,
        "seconds": float(previous.get("seconds") or 0.0) + seconds,
        "val_losses": dict(sorted(val_losses.items(), key=lambda kv: int(kv[0]))),
        "final_loss": final_loss,
        "param_sumsq": param_sumsq,
    }
    if init_from:  # train.init_from: where the run's first weights came from
        summary["init_from"] = init_from
    for key, value in (extra or {}).items():
        earlier = previous.get(key)
        summary[key] = earlier + value if isinstance(value, list) and isinstance(earlier, list) else value
    write_text_atomic(path, json.dumps(json_safe(summary), indent=1))


def completed_step(resume_from: Path | None, steps: int) -> int | None:
    """The step of ``resume_from`` when it already reaches ``train.steps`` (nothing left to train), else None."""
    if resume_from is None:
        return None
    step = int(read_meta(resume_from)["step"])
    return step if step >= steps else None


def _flat(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_changes(saved: dict[str, Any], config: JobConfig) -> dict[str, tuple[Any, Any]]:
    """Resolved keys whose value differs from a checkpoint's config: ``{key: (old, new)}``."""
    old, new = _flat(saved), _flat(config.to_dict())
    return {k: (old[k], new[k]) for k in new if k in old and k not in NOT_COMPARED and old[k] != new[k]}


def check_resumable(changes: dict[str, tuple[Any, Any]], path: Path) -> None:
    """Refuse changes that a resumed run cannot honour (the ones the saved data position depends on)."""
    for key, what in FIXED_ON_RESUME.items():
        if key in changes:
            old, new = changes[key]
            raise CheckpointError(
                f"checkpoint '{path}' was trained with {key}={old}, not {new}; the saved data position depends on "
                f"{what}: resume with {key}={old} or start a new train.run_dir"
            )


def describe_changes(changes: dict[str, tuple[Any, Any]], path: Path) -> str:
    """One line: the keys that changed since ``path`` was saved (each takes effect from the next step)."""
    if not changes:
        return ""
    listed = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changes.items())
    return f"resuming {path.name} with {len(changes)} changed key(s), each taking effect from the next step: {listed}"


@contextlib.contextmanager
def claim_run(run_dir: str | Path) -> Iterator[None]:
    """Hold ``run_dir`` for a training from its first moment (rank 0 only; a ConfigError if it is taken)."""
    if dist_env().rank != 0:
        yield
        return
    lock = RunLock(run_dir).acquire()
    try:
        yield
    finally:
        lock.release()
