"""[checkpoint] and [log]: what a run writes while it trains."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class CheckpointConfig:
    """DCP checkpoints in the run directory."""

    enabled: bool = True  # save checkpoints at all
    every: int = 500  # steps between saves; the last step always saves
    every_minutes: float = 0.0  # also save when this many minutes passed since the last save (0 = off)
    async_save: bool = False  # write in the background (DCP async_save) while training goes on; alias "async"
    keep_last: int = 3  # older checkpoints are deleted
    hf_every: int = (
        0  # also write an HF model directory (RUN/hf/step_N) every this many steps, in the background; 0 off
    )


@dataclass
class LogConfig:
    """Console, metrics.jsonl, TensorBoard, Weights & Biases and the loss plot."""

    every: int = 10  # steps per logged record (loss and grad norm are means over them)
    straggler_ratio: float = 1.5  # flag a rank whose own time in a phase is this times its peers' median; 0 off
    progress: Literal["auto", "bar", "lines", "none"] = "auto"  # auto: a bar on a terminal, else lines
    tensorboard: bool = True  # TensorBoard events in RUN_DIR/tensorboard
    plot: bool = True  # draw RUN_DIR/loss_curve.png at the end
    peak_flops: float = 0.0  # FLOP/s per device for MFU; 0 measures (CPU, cached per machine) or looks up (GPU)
    wandb: bool = False  # also log to Weights & Biases (pip install 'tessera[wandb]')
    wandb_project: str = "tessera"  # W&B project
    wandb_run_name: str = ""  # W&B run name; "" = the run directory's name
    wandb_mode: Literal["auto", "online", "offline"] = "auto"  # auto: $WANDB_MODE, else online if logged in
    mlflow: bool = False  # also log to MLflow (pip install 'tessera[mlflow]')
    mlflow_tracking_uri: str = ""  # "" = sqlite:///RUN_DIR/mlflow.db; or file:DIR, or a server URL
    mlflow_experiment: str = "tessera"  # MLflow experiment name


@dataclass
class EvalConfig:
    """Downstream tasks (lm-eval-harness task YAMLs, local files) scored during training; see docs/evaluation.md."""

    tasks: str = ""  # comma-separated task names, e.g. "stdlib_next_line,stdlib_line_end"; "" = none
    every: int = 0  # steps between task evaluations; 0 = at the end only (when tasks are named)
    task_dirs: str = ""  # comma-separated directories of lm-eval task YAMLs besides the built-in stdlib tasks
    limit: int = 0  # documents per task (0 = all)
    stdlib_docs: int = 200  # documents of each built-in stdlib task


def eval_task_names(e: EvalConfig) -> list[str]:
    """``eval.tasks`` as a list of names."""
    return [t.strip() for t in e.tasks.split(",") if t.strip()]
