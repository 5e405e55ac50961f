"""Hydra config groups (``*.yaml``) for ``zerotrain-train``; the typed dataclasses behind them are
in ``trainer/command/config.py``."""
