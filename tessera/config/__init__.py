"""JobConfig: one typed, strict configuration for a tessera run, and nothing but the configuration.

A job is described by sections (model, parallel, optim, train, data, checkpoint, log), each a
dataclass with defaults in the module of its concern. A TOML recipe under ``configs/`` fills
them; dotted command-line overrides (``--model.n_layers 4`` or ``model.n_layers=4``) come last;
keys of earlier releases are translated by :data:`RENAMED`. Every schema mistake is a
:class:`ConfigError` naming the key and the fix.

This package is a leaf: it imports nothing of tessera but :mod:`tessera.errors`. What the values
mean together (heads divide the width, a kernel supports a layout, a file exists) is checked by
the components that own those keys, all run by :func:`tessera.validate.validate`;
:func:`tessera.validate.load_config` reads and validates in one call.
"""

from __future__ import annotations

from tessera.config.data import DataConfig
from tessera.config.job import SECTIONS, JobConfig
from tessera.config.load import config_from_data, model_config, override_config, parse_overrides, read_config
from tessera.config.model import (
    AttentionConfig,
    GatedDeltaNetConfig,
    KimiDeltaConfig,
    HybridConfig,
    MupConfig,
    MambaConfig,
    DSAConfig,
    MLAConfig,
    ModelConfig,
    MoEConfig,
    PositionConfig,
    layer_heads,
    resolved_objective,
)
from tessera.config.optim import MuonConfig, OptimConfig
from tessera.config.output import CheckpointConfig, EvalConfig, LogConfig, eval_task_names
from tessera.config.parallel import DeepSpeedConfig, FaultToleranceConfig, ParallelConfig
from tessera.config.renames import RENAMED
from tessera.config.train import DistillConfig, TrainConfig
from tessera.errors import ConfigError

__all__ = [
    "EvalConfig",
    "eval_task_names",
    "RENAMED",
    "SECTIONS",
    "AttentionConfig",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "DeepSpeedConfig",
    "FaultToleranceConfig",
    "DistillConfig",
    "JobConfig",
    "LogConfig",
    "DSAConfig",
    "MLAConfig",
    "GatedDeltaNetConfig",
    "KimiDeltaConfig",
    "HybridConfig",
    "MupConfig",
    "MambaConfig",
    "ModelConfig",
    "MoEConfig",
    "MuonConfig",
    "OptimConfig",
    "ParallelConfig",
    "PositionConfig",
    "TrainConfig",
    "config_from_data",
    "layer_heads",
    "model_config",
    "override_config",
    "parse_overrides",
    "read_config",
    "resolved_objective",
]
