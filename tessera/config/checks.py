"""Helpers for the rules that components state about their config keys (each raises ConfigError)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from tessera.errors import ConfigError


def require(ok: bool, message: str) -> None:
    """Raise ConfigError(``message``) unless ``ok``."""
    if not ok:
        raise ConfigError(message)


def require_all(section: str, obj: Any, keys: tuple[str, ...], positive: bool) -> None:
    """Each ``section.key`` is > 0 (``positive``) or >= 0."""
    for key in keys:
        value = getattr(obj, key)
        ok = value > 0 if positive else value >= 0
        require(ok, f"{section}.{key} must be {'positive' if positive else '>= 0'}, got {value}")


def require_finite(prefix: str, obj: Any) -> None:
    """Every float field under ``obj`` is a finite number (NaN and infinity pass most range checks)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            require_finite(f"{prefix}.{f.name}", value)
        elif isinstance(value, float):
            require(math.isfinite(value), f"{prefix}.{f.name} must be a finite number, got {value}")
