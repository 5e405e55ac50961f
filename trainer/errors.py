"""Errors users see. Each names the setting, the value and what would be valid."""


class ConfigError(ValueError):
    """A setting has an invalid value; raised before any process starts."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, or does not match this run."""
