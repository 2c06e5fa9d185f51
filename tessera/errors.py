"""The user-error types: one base class the CLI catches, one subclass per kind of input.

Every layer raises these without importing anything else of tessera. The message is one line that
names the key, flag or file and says how to fix it; ``tessera`` prints it and exits with code 2.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class UserError(ValueError):
    """A problem the user causes and can fix (config, CLI flag, data, checkpoint, launch request)."""


class ConfigError(UserError):
    """A user-caused configuration problem; its message is one line naming the key and the fix."""


class DataError(UserError):
    """A user-caused data problem (missing file, empty corpus, bad index); one line with the fix."""


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete or does not fit the model."""


class LaunchError(UserError):
    """A launch request that cannot work; its message is one line saying what to change."""


def read_json_object(path: str | Path, error: type[UserError], where: str, fix: str) -> dict[str, Any]:
    """The JSON object a user's file holds, or one ``error`` naming ``where`` (the file, or the key that gave it):
    unreadable, not UTF-8, not JSON, or not an object; ``fix`` ends every message (e.g. "; fix or remove it")."""
    try:
        data = json.loads(Path(path).read_bytes().decode("utf-8"))
    except OSError as err:
        raise error(f"{where} cannot be read ({err.strerror}){fix}") from None
    except UnicodeDecodeError as err:
        raise error(f"{where} is not UTF-8 text (byte {err.start}){fix}") from None
    except json.JSONDecodeError as err:
        raise error(f"{where} is not valid JSON ({err}){fix}") from None
    if not isinstance(data, dict):
        raise error(f"{where} must hold a JSON object, got {type(data).__name__}{fix}")
    return data
