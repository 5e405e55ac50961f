"""Packaging for zerotrain.

The repository root *is* the ``zerotrain`` package: ``trainer/`` installs as ``zerotrain.trainer``,
``strategies/`` as ``zerotrain.strategies`` and so on. Nothing else lands in site-packages, so no
generic top-level names (``trainer``, ``callbacks``) can shadow a user's own modules.
"""
from setuptools import find_packages, setup

# Sub-packages found relative to the root, re-rooted under "zerotrain". tests/, bench/ and the
# build folders are not part of the library.
_EXCLUDE = ["tests", "tests.*", "bench", "bench.*", "build", "build.*", "*.egg-info"]
_SUBPACKAGES = [f"zerotrain.{name}" for name in find_packages(".", exclude=_EXCLUDE)]

setup(
    packages=["zerotrain", *_SUBPACKAGES],
    package_dir={"zerotrain": "."},
)
