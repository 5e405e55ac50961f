"""The library's version: one line, importable without importing the rest of the package."""
__version__ = "0.1.0"
