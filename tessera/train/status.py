"""A run's state at a glance: ``tessera status RUN`` (nothing here imports torch, so it is instant)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tomllib

from tessera.errors import ConfigError
from tessera.train.goodput import status_line as goodput_line
from tessera.train.lock import Holder, duration, read_json, run_holder
from tessera.train.straggler_table import status_table as straggler_table


def read_records(run_dir: str | Path) -> list[dict[str, Any]]:
    """metrics.jsonl records: JSON objects with an integer ``step``, numeric losses. A line still being written,
    torn by a crash, not UTF-8 or not a record is skipped: the file is the run's log, never a reason to fail."""
    path = Path(run_dir) / "metrics.jsonl"
    try:
        text = path.read_bytes().decode("utf-8", errors="replace") if path.is_file() else ""
    except OSError:
        return []
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if _is_record(record):
            records.append(record)
    return records


def _is_record(record: Any) -> bool:
    numbers = (int, float)
    return (
        isinstance(record, dict)
        and type(record.get("step")) is int
        and all(isinstance(record[k], numbers) for k in ("loss", "val_loss") if k in record)
    )


def _run_config(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "config.toml"
    if not path.is_file():
        raise ConfigError(
            f"'{run_dir}' is not a tessera run directory (no config.toml); give train.run_dir of a run, e.g. runs/smoke"
        )
    try:
        return tomllib.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(f"'{path}' is not UTF-8 text (byte {err.start}); restore the run's config.toml") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"'{path}' is not valid TOML: {err}") from None


def _latest_checkpoint(run_dir: Path) -> tuple[Path, int] | None:
    done = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if (p / "meta.json").is_file())
    return (done[-1], int(done[-1].name.removeprefix("step_"))) if done else None


def _seconds_per_step(records: list[dict[str, Any]], since: float, tokens_per_step: int) -> float | None:
    """Wall seconds per step over the recent records of this session (evaluation included)."""
    timed = [r for r in records if "loss" in r and r.get("time", 0) >= since][-20:]
    if len(timed) >= 2 and timed[-1]["step"] > timed[0]["step"]:
        return (timed[-1]["time"] - timed[0]["time"]) / (timed[-1]["step"] - timed[0]["step"])
    last = next((r for r in reversed(records) if r.get("tokens_per_s")), None)
    return tokens_per_step / last["tokens_per_s"] if last else None


def _state_line(run_dir: Path, holder: Holder | None, step: int, total: int) -> str:
    if holder is not None:
        return "running: " + holder.describe()
    preempted = read_json(run_dir / "preempted.json")  # the trainer's marker: signal, step, checkpoint
    if preempted:
        return (
            f"stopped by {preempted.get('signal', 'a signal')} at step {preempted.get('step', '?')} "
            "after a checkpoint; "
            f"`tessera train {run_dir / 'config.toml'}` continues it"
        )
    if step >= total:
        return "finished"
    return f"not running (stopped at step {step} of {total}); `tessera train {run_dir / 'config.toml'}` continues it"


def _count(train: dict[str, Any], key: str, default: int, run_dir: Path) -> int:
    value = train.get(key, default)
    if type(value) is not int:
        raise ConfigError(f"'{run_dir / 'config.toml'}': train.{key} must be an integer, got {value!r}; restore it")
    return value


def run_status(run_dir: str | Path) -> str:
    """The report ``tessera status`` prints; safe to call while the run is training."""
    run_dir = Path(run_dir)
    holder = run_holder(run_dir)
    if holder is not None and not (run_dir / "config.toml").is_file():
        return f"{'run':<12} {run_dir}\n{'state':<12} starting (preparing data and model): {holder.describe()}"
    train = _run_config(run_dir).get("train", {})
    train = train if isinstance(train, dict) else {}
    total = _count(train, "steps", 0, run_dir)
    tokens_per_step = (
        _count(train, "batch_size", 0, run_dir)
        * _count(train, "grad_accum", 1, run_dir)
        * _count(train, "seq_len", 0, run_dir)
    )
    records = read_records(run_dir)
    trained = [r for r in records if "loss" in r]
    checkpoint = _latest_checkpoint(run_dir)
    step = max([r["step"] for r in records] + [holder.step if holder else 0, checkpoint[1] if checkpoint else 0])
    vals = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    lines = [
        ("run", str(run_dir)),
        ("state", _state_line(run_dir, holder, step, total)),
        ("step", f"{step:,} / {total:,} ({100 * step / max(total, 1):.0f}%)"),
        ("tokens seen", f"{step * tokens_per_step:,}"),
    ]
    if trained:
        lines.append(
            ("train loss", f"{trained[-1]['loss']:.4f} at step {trained[-1]['step']} (mean of its logging window)")
        )
    if vals:
        best = min(vals, key=lambda v: v[1])
        lines.append(
            ("val loss", f"last {vals[-1][1]:.4f} at step {vals[-1][0]}; best {best[1]:.4f} at step {best[0]}")
        )
    lines.append(("checkpoint", f"{checkpoint[0]} (step {checkpoint[1]})" if checkpoint else "none yet"))
    per_step = _seconds_per_step(records, holder.started if holder else 0.0, tokens_per_step) if trained else None
    if per_step:
        speed = f"{per_step:.2f} s/step, {tokens_per_step / per_step:,.0f} tokens/s"
        eta = f"; ETA {duration(per_step * (total - step))}" if holder is not None and step < total else ""
        lines.append(("speed", speed + eta))
    return "\n".join(
        [f"{name:<12} {value}" for name, value in lines] + goodput_line(run_dir) + straggler_table(run_dir)
    )
