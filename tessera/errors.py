"""The user-error types: one base class the CLI catches, one subclass per kind of input.

Every layer raises these without importing anything else of tessera. The message is one line that
names the key, flag or file and says how to fix it; ``tessera`` prints it and exits with code 2.
"""

from __future__ import annotations


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
