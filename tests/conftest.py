"""Shared test set-up: tests/ and tests/distributed/ are importable by plain module name, so that
worker functions for multi-process tests can be found again in the child processes."""
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
for sub in ("", "distributed"):
    path = os.path.join(_HERE, sub)
    if path not in sys.path:
        sys.path.insert(0, path)
