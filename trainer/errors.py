"""Errors users see. Each names the setting, the value and what would be valid."""


class MisconfigurationException(Exception):
    """Lightning's error for a setting that cannot work (``zerotrain.utilities.exceptions``)."""


class ConfigError(MisconfigurationException, ValueError):
    """A setting has an invalid value; raised before any process starts. A
    ``MisconfigurationException`` (and a ``ValueError``), so a ported
    ``pytest.raises(MisconfigurationException)`` catches it."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, or does not match this run."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """``ckpt_path`` names nothing on disk (a ``FileNotFoundError`` too, as Lightning raises)."""
