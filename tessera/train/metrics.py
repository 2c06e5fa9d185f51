"""Training metrics: the logging window, a console bar or lines, metrics.jsonl, TensorBoard, W&B and a loss plot."""

from __future__ import annotations

import json
import os
import math
import secrets
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import torch

from tessera.config import ConfigError, JobConfig, LogConfig
from tessera.train.lock import RunLock
from tessera.train.status import read_records


def _human(n: float) -> str:
    for unit in ("", "k", "M", "G"):
        if abs(n) < 1000:
            return f"{n:.1f}{unit}"
        n /= 1000
    return f"{n:.1f}T"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"
    )


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None (JSON has no NaN or infinity)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def format_step(record: dict[str, Any], total_steps: int, eta_s: float | None) -> str:
    """One human line for a logged step."""
    parts = [f"step {record['step']}/{total_steps}"]
    if "loss" in record:
        parts += [f"loss {record['loss']:.4f}", f"lr {record['lr']:.2e}", f"gnorm {record['grad_norm']:.3f}"]
        parts += [f"{_human(record['tokens_per_s'])} tok/s", f"mfu {100 * record['mfu']:.2f}%"]
    if "val_loss" in record:
        parts.append(f"val {record['val_loss']:.4f} (ppl {record['val_ppl']:.1f})")
    if eta_s is not None:
        parts.append(f"eta {_duration(eta_s)}")
    return " | ".join(parts)


def _bar_text(record: dict[str, Any]) -> str:
    """What the progress bar shows after the bar itself."""
    parts = []
    if "loss" in record:
        parts = [
            f"loss {record['loss']:.4f}",
            f"{_human(record['tokens_per_s'])} tok/s",
            f"mfu {100 * record['mfu']:.1f}%",
        ]
    if "val_loss" in record:
        parts.append(f"val {record['val_loss']:.4f}")
    return " | ".join(parts)


def _add(a: Any, b: Any) -> Any:
    return [_add(x, y) for x, y in zip(a, b, strict=True)] if isinstance(a, list) else a + b


def _scale(a: Any, factor: float) -> Any:
    return [_scale(x, factor) for x in a] if isinstance(a, list) else a * factor


class StepWindow:
    """The steps since the last logged one, reduced to what is logged.

    ``loss`` and the other per-step metrics (grad norm, MoE balance) are means over the window,
    ``lr`` the last step's; tokens/s is the window's tokens over its seconds, so MFU is smoothed
    the same way. MFU is capped at 1: above it the peak (a measurement on CPU) was too low.
    """

    def __init__(self, flops_per_token: float, peak_flops_total: float) -> None:
        self.flops_per_token, self.peak = flops_per_token, peak_flops_total
        self._reset()

    def _reset(self) -> None:
        self.sums: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.steps, self.tokens, self.seconds = 0, 0, 0.0

    def add(self, metrics: dict[str, float], tokens: int, seconds: float) -> None:
        """One optimizer step's metrics, tokens and wall seconds (tables, e.g. MoE load per layer and
        expert, are averaged element by element)."""
        for key, value in metrics.items():
            self.sums[key] = _add(self.sums[key], value) if key in self.sums else value
        self.last = dict(metrics)
        self.steps, self.tokens, self.seconds = self.steps + 1, self.tokens + tokens, self.seconds + seconds

    def flush(self) -> dict[str, float]:
        """The window's record fields (empty when no step was added); starts a new window."""
        if not self.steps:
            return {}
        record = {key: _scale(total, 1.0 / self.steps) for key, total in self.sums.items()}
        record["lr"] = self.last.get("lr", 0.0)
        tokens_per_s = self.tokens / max(self.seconds, 1e-12)
        mfu = min(1.0, tokens_per_s * self.flops_per_token / self.peak) if self.peak else 0.0
        record.update(tokens_per_s=tokens_per_s, mfu=mfu)
        self._reset()
        return record


def tensorboard_tag(key: str) -> str:
    """Grouped TensorBoard / W&B names: ``val/loss``, ``moe/aux_loss``, ``perf/mfu``, ``train/loss``."""
    if key.startswith("val_"):
        return "val/" + key.removeprefix("val_")
    if key.startswith("moe_"):
        return "moe/" + key.removeprefix("moe_")
    if key in ("tokens_per_s", "mfu"):
        return "perf/" + key
    if key.startswith("eval/"):  # downstream tasks: eval/<task>/<metric>
        return key
    return "train/" + key


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    return {
        tensorboard_tag(k): v for k, v in record.items() if k not in ("step", "time") and isinstance(v, (int, float))
    }


def _tables(record: dict[str, Any]) -> dict[str, list[list[float]]]:
    return {k: v for k, v in record.items() if isinstance(v, list) and v and isinstance(v[0], list)}


def check_sinks(log: LogConfig) -> None:
    """ConfigError when an enabled sink's optional package is missing (before any work starts)."""
    import importlib.util

    if log.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "log.wandb=true needs the wandb package: pip install 'tessera[wandb]' (or set log.wandb=false)"
        )
    if log.mlflow and importlib.util.find_spec("mlflow") is None:
        raise ConfigError(
            "log.mlflow=true needs the mlflow package: pip install 'tessera[mlflow]' (or set log.mlflow=false)"
        )


def _mlflow_key(tag: str) -> str:
    """An MLflow metric name (letters, digits, ``_-./ :`` only)."""
    return "".join(c if c.isalnum() or c in "_-./ :" else "_" for c in tag)


class MlflowSink:
    """An MLflow run (default store: ``sqlite:///RUN_DIR/mlflow.db``); resumed runs continue the same MLflow run.

    A ``file:`` tracking URI (MLflow's file store, in maintenance mode since MLflow 3) is honoured: naming it
    is the opt-in MLflow asks for (``MLFLOW_ALLOW_FILE_STORE``)."""

    def __init__(self, run_dir: Path, log: LogConfig, config: dict[str, Any]) -> None:
        check_sinks(log)
        from mlflow.tracking import MlflowClient

        uri = log.mlflow_tracking_uri or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        id_file = run_dir / "mlflow-id.txt"
        if id_file.is_file():
            self.run_id = id_file.read_text().strip()
        else:
            experiment = self.client.get_experiment_by_name(log.mlflow_experiment)
            exp_id = experiment.experiment_id if experiment else self.client.create_experiment(log.mlflow_experiment)
            self.run_id = self.client.create_run(exp_id, run_name=run_dir.name).info.run_id
            id_file.write_text(self.run_id + "\n")
            for section, values in config.items():
                for key, value in values.items() if isinstance(values, dict) else []:
                    self.client.log_param(self.run_id, f"{section}.{key}", str(value)[:500])
        self.uri = uri

    def log(self, record: dict[str, Any]) -> None:
        """One record's numbers, under the grouped tags, at ``step``."""
        from mlflow.entities import Metric

        stamp = int(record.get("time", time.time()) * 1000)
        metrics = [Metric(_mlflow_key(k), v, stamp, record["step"]) for k, v in _scalars(record).items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        """Mark the MLflow run finished."""
        self.client.set_terminated(self.run_id)


class WandbSink:
    """A Weights & Biases run in ``RUN_DIR/wandb``; resumed runs continue the same W&B run."""

    def __init__(self, run_dir: Path, log: LogConfig, config: dict[str, Any]) -> None:
        check_sinks(log)
        import wandb

        id_file = run_dir / "wandb-id.txt"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
        id_file.write_text(run_id + "\n")
        self.mode, self.why = wandb_mode(log.wandb_mode)
        self.run = wandb.init(
            project=log.wandb_project,
            name=log.wandb_run_name or run_dir.name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            config=config,
            mode=self.mode,
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")  # re-logged steps after a resume are fine

    def log(self, record: dict[str, Any]) -> None:
        """One record, under the grouped tags, against ``step``."""
        self.run.log({"step": record["step"], **_scalars(record)})

    def close(self) -> None:
        """Finish the W&B run (offline: its files stay in RUN_DIR/wandb for ``wandb sync``)."""
        self.run.finish()


def wandb_mode(configured: str, timeout: float = 3.0) -> tuple[str | None, str]:
    """(mode for ``wandb.init``, why): ``$WANDB_MODE`` or the setting, else online only when logged in and reachable."""
    import netrc
    import os
    import socket
    from urllib.parse import urlparse

    if configured != "auto":
        return configured, "log.wandb_mode"
    if os.environ.get("WANDB_MODE"):
        return None, "WANDB_MODE"  # wandb reads it itself
    url = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
    host, port = url.hostname or "api.wandb.ai", url.port or (443 if url.scheme == "https" else 80)
    try:
        key = os.environ.get("WANDB_API_KEY") or (netrc.netrc().authenticators(host) or (None, None, None))[2]
    except (OSError, netrc.NetrcParseError):
        key = None
    if not key:
        return "offline", "no W&B API key (wandb login)"
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError:
        return "offline", f"{host} unreachable"
    return "online", "logged in"


class MetricsLogger:
    """Writes each record to metrics.jsonl, TensorBoard, W&B and MLflow and shows progress on the console.

    ``progress``: "bar" is a tqdm bar (steps, loss, tokens/s, MFU, ETA) on a terminal, "lines"
    prints a line per logged step (logs, CI), "none" prints nothing, "auto" picks "bar" on a
    terminal else "lines". An enabled logger (rank 0) also holds the run's :class:`RunLock`.
    """

    def __init__(
        self,
        run_dir: str | Path,
        total_steps: int,
        progress: str = "auto",
        tensorboard: bool = True,
        stream: TextIO | None = None,
        enabled: bool = True,
        wandb: LogConfig | None = None,
        config: dict[str, Any] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.total_steps = total_steps
        self.stream = stream or sys.stdout
        if progress == "auto":
            progress = "bar" if self.stream.isatty() else "lines"
        self.enabled = enabled
        self.progress = progress if enabled else "none"
        self.lock: RunLock | None = None
        self.jsonl: TextIO | None = None
        self.tb: Any = None
        self.wandb: WandbSink | None = None
        self.mlflow: MlflowSink | None = None
        self.bar: Any = None
        self.started = time.perf_counter()
        self.start_step: int | None = None
        if enabled:
            try:
                self._open_sinks(tensorboard, wandb, config or {})
            except BaseException:
                self.close()
                raise

    def _open_sinks(self, tensorboard: bool, wandb: LogConfig | None, config: dict[str, Any]) -> None:
        self.lock = RunLock(self.run_dir).acquire()
        self.jsonl = open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        if wandb is not None and wandb.wandb:
            self.wandb = WandbSink(self.run_dir, wandb, config)
            if self.wandb.why != "WANDB_MODE":
                self.print(f"wandb: {self.wandb.mode} ({self.wandb.why})")
        if wandb is not None and wandb.mlflow:
            self.mlflow = MlflowSink(self.run_dir, wandb, config)

    @classmethod
    def for_job(cls, config: JobConfig, enabled: bool = True) -> MetricsLogger:
        """The logger a :class:`~tessera.config.JobConfig` asks for."""
        log = config.log
        return cls(
            config.train.run_dir,
            config.train.steps,
            log.progress,
            log.tensorboard,
            enabled=enabled,
            wandb=log if log.wandb or log.mlflow else None,
            config=config.to_dict(),
        )

    def log(self, record: dict[str, Any]) -> None:
        """Record one step's metrics (``step`` plus any numbers); a disabled logger (ranks > 0) drops it."""
        if self.jsonl is None:
            return
        record = {**record, "time": round(time.time(), 3)}
        self.jsonl.write(json.dumps(json_safe(record), allow_nan=False) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for tag, value in _scalars(record).items():
                self.tb.add_scalar(tag, value, record["step"])
            for key, rows in _tables(record).items():  # e.g. MoE load per layer and expert: one histogram a row
                for i, row in enumerate(rows):
                    self.tb.add_histogram(f"{tensorboard_tag(key)}/{i}", torch.tensor(row), record["step"])
        if self.wandb is not None:
            self.wandb.log(record)
        if self.mlflow is not None:
            self.mlflow.log(record)
        if self.lock is not None:
            self.lock.heartbeat(record["step"])
        self._show(record)

    def _eta(self, step: int) -> float | None:
        if self.start_step is None:
            self.start_step, self.started = step, time.perf_counter()
            return None
        done = step - self.start_step
        return (time.perf_counter() - self.started) / done * (self.total_steps - step) if done > 0 else None

    def _show(self, record: dict[str, Any]) -> None:
        if self.progress == "none":
            return
        if self.progress == "bar":
            self._show_bar(record)
            return
        self.stream.write(format_step(record, self.total_steps, self._eta(record["step"])) + "\n")
        self.stream.flush()

    def _show_bar(self, record: dict[str, Any]) -> None:
        from tqdm import tqdm

        if self.bar is None:
            self.bar = tqdm(
                total=self.total_steps,
                initial=record["step"],
                file=self.stream,
                unit="step",
                dynamic_ncols=True,
                bar_format="step {n_fmt}/{total_fmt} {percentage:3.0f}%|{bar}| {desc} [{elapsed}<{remaining}]",
            )
        if "val_loss" in record:
            self.bar.write(format_step(record, self.total_steps, None), file=self.stream)
        self.bar.set_description_str(_bar_text(record), refresh=False)
        self.bar.update(record["step"] - self.bar.n)
        self.bar.refresh()

    def print(self, message: str) -> None:
        """A message on the console (above the bar while it is live)."""
        if self.progress == "none":
            return
        if self.bar is not None:
            self.bar.write(message, file=self.stream)
            return
        self.stream.write(message + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Close the bar and the sinks; release the run."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        for sink in (self.jsonl, self.tb, self.wandb, self.mlflow):
            if sink is not None:
                sink.close()
        if self.lock is not None:
            self.lock.release()
        self.jsonl = self.tb = self.wandb = self.mlflow = self.lock = None


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All records of a run's metrics.jsonl (a torn, undecodable or foreign line is skipped)."""
    return read_records(run_dir)


def plot_loss_curve(run_dir: str | Path) -> Path:
    """Draw training and validation loss against step into ``loss_curve.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        ax.plot(*zip(*train), label="train loss (logging-window mean)", linewidth=1)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss", markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(Path(run_dir).name)
    ax.grid(alpha=0.3)
    ax.legend()
    out = Path(run_dir) / "loss_curve.png"
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
