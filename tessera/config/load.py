"""Reading a config: TOML files, nested data and dotted overrides into a JobConfig, strictly typed.

Only the schema is checked here (unknown sections and keys, types, choices); what the values mean
together is checked by ``tessera.validate.validate``, which the components' owners supply.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal

import tomllib

from tessera.config.job import SECTIONS, JobConfig
from tessera.config.model import ModelConfig
from tessera.config.renames import RENAMED
from tessera.errors import ConfigError


def _suggest(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _fields(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_table(hint: Any) -> bool:
    return dataclasses.is_dataclass(hint)


def _check_text(key: str, value: Any, hint: Any) -> None:
    """A string value is UTF-8 text (a command line of other bytes arrives as lone surrogates) and, for a number,
    ASCII: ``int``/``float`` would read fullwidth or Arabic-Indic digits as a number nobody typed."""
    if not isinstance(value, str):
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"{key} is not UTF-8 text ({value!a}); give the value as UTF-8") from None
    if hint in (int, float) and not value.isascii():
        kind = "an integer" if hint is int else "a number"
        raise ConfigError(f"{key} must be {kind} in ASCII digits, got {value!r}")


def _integer(key: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise ConfigError(f"{key} must be an integer, got {value!r}")


def _in_int64(key: str, value: int) -> int:
    """Every integer key fits int64: a larger one overflows torch, numpy and float arithmetic later."""
    if not -(2**63) <= value < 2**63:
        raise ConfigError(f"{key} = {value} is out of range; integers must lie in [-2**63, 2**63)")
    return value


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Convert ``value`` (from TOML or a CLI string) to the field type ``hint``, or fail clearly."""
    _check_text(key, value, hint)
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        if True in choices and isinstance(value, str) and value.lower() in ("true", "false"):
            value = value.lower() == "true"  # a switch with an "auto" setting: true/false from the CLI
        if value not in choices:
            opts = ", ".join(repr(c) for c in choices)
            raise ConfigError(
                f"{key} = {value!r} is not one of {opts}{_suggest(str(value), [str(c) for c in choices])}"
            )
        return value
    if isinstance(hint, types.UnionType) or origin is typing.Union:
        raise TypeError(f"unsupported field type {hint} for {key}")
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if hint is int:
        return _in_int64(key, _integer(key, value))
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key} must be a number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key} must be a string, got {value!r}")
    raise TypeError(f"unsupported field type {hint} for {key}")


def _set(config: JobConfig, dotted: str, value: Any) -> None:
    """Set ``section.key`` (or ``section.table.key``) to ``value``, coerced to the field's type."""
    if dotted in RENAMED and not isinstance(value, dict):
        dotted = RENAMED[dotted]
    section, _, rest = dotted.partition(".")
    if section not in SECTIONS:
        raise ConfigError(
            f"unknown config section '{section}' in '{dotted}'{_suggest(section, list(SECTIONS))}; "
            f"sections: {', '.join(SECTIONS)}"
        )
    if not rest:
        raise ConfigError(f"config key '{dotted}' must look like section.key, e.g. model.n_layers")
    target, path = getattr(config, section), section
    *tables, name = rest.split(".")
    for table in tables:
        hint = _fields(type(target)).get(table)
        if not _is_table(hint):
            raise ConfigError(f"unknown config table '{path}.{table}' in '{dotted}'{_suggest(table, _tables(target))}")
        target, path = getattr(target, table), f"{path}.{table}"
    fields = _fields(type(target))
    if name not in fields:
        raise ConfigError(f"unknown config key '{dotted}'{_suggest(name, list(fields))}")
    if _is_table(fields[name]):
        keys = ", ".join(_fields(fields[name]))
        raise ConfigError(
            f"{dotted} is a table; set one of its keys, e.g. {dotted}.{next(iter(_fields(fields[name])))} ({keys})"
        )
    setattr(target, name, _coerce(dotted, value, fields[name]))


def _tables(target: Any) -> list[str]:
    return [k for k, hint in _fields(type(target)).items() if _is_table(hint)]


def _apply_mapping(config: JobConfig, data: dict[str, Any], where: str) -> None:
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(
                f"{where}: top-level key '{section}' must be a [section] table{_suggest(section, list(SECTIONS))}"
            )
        if section not in SECTIONS:
            raise ConfigError(
                f"{where}: unknown section [{section}]{_suggest(section, list(SECTIONS))}; sections: "
                f"{', '.join(SECTIONS)}"
            )
        for dotted, value in _flatten(section, values):
            _set(config, dotted, value)


def _flatten(prefix: str, values: dict[str, Any]) -> list[tuple[str, Any]]:
    """Nested TOML tables as (dotted key, value) pairs."""
    pairs: list[tuple[str, Any]] = []
    for key, value in values.items():
        if isinstance(value, dict):
            pairs += _flatten(f"{prefix}.{key}", value)
        else:
            pairs.append((f"{prefix}.{key}", value))
    return pairs


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """Turn ``['--model.dim', '64', 'train.steps=5']`` into ``[('model.dim', '64'), ('train.steps', '5')]``."""
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--") and "=" in arg:
            key, value = arg[2:].split("=", 1)
        elif arg.startswith("--"):
            if i + 1 >= len(args):
                raise ConfigError(f"override '{arg}' has no value; write '{arg} VALUE' or '{arg[2:]}=VALUE'")
            key, value = arg[2:], args[i + 1]
            i += 1
        elif "=" in arg:
            key, value = arg.split("=", 1)
        else:
            raise ConfigError(f"cannot read override '{arg}'; write section.key=VALUE or --section.key VALUE")
        if "." not in key:
            raise ConfigError(f"override '{arg}' must name section.key, e.g. --model.n_layers 4")
        pairs.append((key, value))
        i += 1
    return pairs


def _read_toml(path: Path) -> dict[str, Any]:
    """The tables of a TOML recipe; every way the file can be unreadable is one ConfigError."""
    if path.is_dir():
        raise ConfigError(f"config path '{path}' is a directory; pass a TOML recipe such as configs/smoke.toml")
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist; pass a TOML recipe such as configs/smoke.toml")
    try:
        return tomllib.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"config file '{path}' is not UTF-8 text (byte {err.start} is invalid); pass a TOML recipe"
        ) from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file '{path}' is not valid TOML: {err}") from None
    except OSError as err:
        raise ConfigError(f"config file '{path}' cannot be read ({err.strerror})") from None


def model_config(**keys: Any) -> ModelConfig:
    """A ModelConfig from keyword arguments: top-level keys, sub-table keys as dicts
    (``moe={"experts": 4}``) or the flat names of earlier releases (``moe_experts=4``)."""
    config = JobConfig()
    _apply_mapping(config, {"model": keys}, "model config")
    return config.model


def read_config(path: str | Path | None = None, overrides: list[str] | None = None) -> JobConfig:
    """A TOML recipe (or the defaults when ``path`` is None) with dotted ``overrides`` applied; schema
    checks only (``tessera.validate.load_config`` also validates what the values mean together)."""
    config = JobConfig()
    if path is not None:
        _apply_mapping(config, _read_toml(Path(path)), str(path))
    return override_config(config, overrides or [])


def override_config(config: JobConfig, overrides: list[str]) -> JobConfig:
    """``config`` with dotted ``overrides`` (as on the command line) applied in place; schema checks only."""
    for key, value in parse_overrides(overrides):
        _set(config, key, value)
    return config


def config_from_data(data: dict[str, Any], where: str = "config") -> JobConfig:
    """A JobConfig from nested plain data (e.g. a checkpoint's config.json); schema checks only."""
    config = JobConfig()
    _apply_mapping(config, data, where)
    return config
