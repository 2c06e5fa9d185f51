"""The one validation pass: every rule a component states about its keys, run before any process starts.

:mod:`tessera.config` reads and type-checks a job; the rules of what the values mean together live
with the components that own them (``model/rules.py``, ``data/rules.py``, ``train/rules.py``,
``parallel/rules.py``, ``layout.check_layout``) and run here in one place. The loaders below are
the ones every command uses: read, then validate.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tessera.config import SECTIONS, JobConfig, config_from_data, override_config, read_config
from tessera.config.checks import require_finite
from tessera.data import rules as data_rules
from tessera.evaluate import rules as eval_rules
from tessera.layout import check_layout
from tessera.model.rules import check_document_masks, validate_model
from tessera.parallel import rules as engine_rules
from tessera.parallel.ft import check_fault_tolerance
from tessera.train import rules as train_rules

__all__ = ["apply_overrides", "config_from_dict", "load_config", "validate", "validate_model"]


def validate(config: JobConfig) -> None:
    """Cross-field checks: everything that can be known wrong before a process starts."""
    validate_model(config.model)
    for section in SECTIONS:
        require_finite(section, getattr(config, section))
    data_rules.check_objective(config.model, config.train)
    data_rules.check_objective_split(config.model, config.train, config.parallel.cp)
    train_rules.check_train(config.train, config.model)
    train_rules.check_optim(config.optim, config.train)
    train_rules.check_qk_clip(config.optim, config.model)
    check_layout(config)
    data_rules.check_data(config.data)
    engine_rules.check_engine(config.parallel, config.train)
    check_fault_tolerance(config.parallel, config.train)  # [parallel.ft] (parallel/ft.py)
    engine_rules.check_fp8(config)
    engine_rules.check_qat(config)
    engine_rules.check_engine_optimizer(config.parallel, config.optim)
    check_document_masks(config)
    data_rules.check_blend_schedule(config.data.blend_schedule, config.train.steps)
    train_rules.check_output(config)
    eval_rules.check_eval(config)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> JobConfig:
    """Load a TOML recipe (or the defaults when ``path`` is None), apply overrides, validate."""
    config = read_config(path, overrides)
    validate(config)
    return config


def apply_overrides(config: JobConfig, overrides: list[str]) -> JobConfig:
    """``config`` with dotted ``overrides`` (as on the command line) applied, then validated."""
    override_config(config, overrides)
    validate(config)
    return config


def config_from_dict(data: dict[str, Any], where: str = "config") -> JobConfig:
    """Build and validate a JobConfig from nested plain data (e.g. a checkpoint's config.json)."""
    config = config_from_data(data, where)
    validate(config)
    return config
