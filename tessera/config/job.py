"""JobConfig: the sections together, and the resolved config written back as TOML."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from tessera.config.data import DataConfig
from tessera.config.model import ModelConfig
from tessera.config.optim import OptimConfig
from tessera.config.output import CheckpointConfig, EvalConfig, LogConfig
from tessera.config.parallel import ParallelConfig
from tessera.config.train import TrainConfig


@dataclass
class JobConfig:
    """A complete tessera job: the sections below, nothing else."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The config as nested plain data (TOML/JSON-ready)."""
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        """The resolved config as a TOML recipe that :func:`load_config` reads back."""
        lines: list[str] = []
        for section, values in self.to_dict().items():
            lines += _toml_table(section, values)
        return "\n".join(lines)


def _toml_table(name: str, values: dict[str, Any]) -> list[str]:
    """``[name]`` with its scalar keys, then each sub-table as ``[name.sub]``."""
    lines = [f"[{name}]"] + [f"{k} = {_toml_value(v)}" for k, v in values.items() if not isinstance(v, dict)]
    lines.append("")
    for key, sub in values.items():
        if isinstance(sub, dict):
            lines += _toml_table(f"{name}.{key}", sub)
    return lines


_TOML_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def toml_string(text: str) -> str:
    """``text`` as a TOML basic string that ``tomllib`` reads back equal: any Unicode stays as it is (emoji
    included) except the quote, the backslash and the control characters TOML forbids raw (DEL among them)."""
    out = []
    for char in text:
        if char in _TOML_ESCAPES:
            out.append(_TOML_ESCAPES[char])
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, float):
        return repr(value)
    return str(value)


SECTIONS: dict[str, type] = typing.get_type_hints(JobConfig)
