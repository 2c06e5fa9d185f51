"""The user-error type every layer can raise without importing anything else of tessera."""

from __future__ import annotations


class ConfigError(ValueError):
    """A user-caused configuration problem; its message is one line naming the key and the fix."""
