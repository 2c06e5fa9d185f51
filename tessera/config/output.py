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

