"""Builds and loads zerotrain's compiled ops, once, into a cache that outlives the process.

Each op is a small frozen :class:`OpSpec` (sources, flags). :func:`load_op` compiles it with
``torch.utils.cpp_extension.load`` on first use, into::

    <cache root>/<tag>/<op name>-<digest>/

* ``<cache root>``: ``$ZEROTRAIN_EXTENSIONS_DIR`` if set, else ``~/.cache/zerotrain/extensions``
  (``$XDG_CACHE_HOME`` replaces ``~/.cache``);
* ``<tag>``: the Python and torch versions and the machine architecture, so an upgrade never
  loads a stale binary;
* ``<digest>``: 12 hex digits of a hash of the op's sources, every file in its include folders
  and its build flags. Two checkouts with different sources build into different folders; the
  same source is built once and reused by every checkout and venv. The sources are copied into
  ``src/`` of the folder and compiled from there, so the build never depends on the checkout.

A finished build leaves a marker (``zerotrain.built``); later processes load the ``.so`` directly
(well under a second, no lock). Building holds ``zerotrain.lock`` in the folder, waiting at most
``$ZEROTRAIN_BUILD_TIMEOUT_S`` seconds for another builder and taking over a dead one's lock
(:mod:`zerotrain.ops.build_lock`).

No ``-march=native``: the CPU kernel picks its SIMD path at run time (see csrc/adam/cpu_adam.cpp),
so a cache built on one machine serves any x86-64 CPU with the same Python and torch.

``$ZEROTRAIN_BUILD_OPS`` chooses the policy:

* unset: build on first use (saying so on stderr first: build ahead with ``zerotrain-build-ops``);
  if the toolchain is missing or the build fails, warn once and use the pure-torch fallback
  (:mod:`zerotrain.ops.reference`).
* ``1``: strict; a failed build raises.
* ``0``: never compile; always use the fallback, silently.
"""
from __future__ import annotations

import filecmp
import hashlib
import importlib.util
import logging
import os
import platform
import re
import shutil
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Optional

import torch

from .build_lock import (  # noqa: F401  (re-exported: the build lock's names were here)
    BATON_NAME, BUILD_TIMEOUT_ENV, DEFAULT_BUILD_TIMEOUT_S, LOCK_NAME, BuildLockTimeout, _say, build_lock,
    build_timeout_s, owner_alive,
)

log = logging.getLogger(__name__)

# The package root (zerotrain/), which holds csrc/.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD_POLICY_ENV = "ZEROTRAIN_BUILD_OPS"
CACHE_DIR_ENV = "ZEROTRAIN_EXTENSIONS_DIR"
BUILT_MARKER = "zerotrain.built"
_LAYOUT_VERSION = "1"  # bump to invalidate every cached build


@dataclass(frozen=True)
class OpSpec:
    """What to compile for one op: a build descriptor, nothing more."""

    name: str
    sources: tuple[str, ...]  # relative to `root`
    include_dirs: tuple[str, ...] = ()  # relative to `root`
    cflags: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()
    cuda_cflags: tuple[str, ...] = ()
    cuda: bool = False
    # False: a plain shared library that registers torch ops (torch.ops.zerotrain.*) on load;
    # load_op then returns the torch.ops.zerotrain namespace.
    is_python_module: bool = True
    root: Optional[str] = None  # the folder `sources` are relative to; None: the package root
    build_estimate_s: int = 60  # what the "compiling ..." line promises
    #: the variable that forces a CPU op's SIMD path (None: the op has one path)
    isa_env: Optional[str] = None
    #: the module a caller falls back to without the compiled op (the report names it)
    fallback: str = "zerotrain.ops.reference"

    @property
    def root_dir(self) -> str:
        return self.root or _ROOT

    def absolute_sources(self) -> list[str]:
        return [os.path.join(self.root_dir, s) for s in self.sources]

    def absolute_includes(self) -> list[str]:
        return [os.path.join(self.root_dir, s) for s in self.include_dirs]

    def input_files(self) -> list[str]:
        """Every file the build reads from `root`, relative to it: sources, then headers."""
        files = list(self.sources)
        for inc in self.include_dirs:
            for dirpath, dirnames, filenames in os.walk(os.path.join(self.root_dir, inc)):
                dirnames.sort()
                for f in sorted(filenames):
                    files.append(os.path.relpath(os.path.join(dirpath, f), self.root_dir))
        return files


CPU_ADAM = OpSpec(
    name="zerotrain_cpu_adam",
    sources=("csrc/adam/cpu_adam.cpp",),
    include_dirs=("csrc/includes",),
    # -Wno-psabi: vector arguments cross functions with different target attributes by design.
    cflags=("-O3", "-fopenmp", "-Wno-psabi"),
    ldflags=("-fopenmp",),
    isa_env="ZEROTRAIN_ADAM_ISA",
)

FUSED_ADAM_CUDA = OpSpec(
    name="zerotrain_fused_adam_cuda",
    sources=("csrc/adam/fused_adam.cu",),
    include_dirs=("csrc/includes",),  # adam_scalars.h, shared with the CPU op
    cflags=("-O3",),
    cuda_cflags=("-O3",),
    cuda=True,
    is_python_module=False,
    build_estimate_s=180,
)

QUANTIZE = OpSpec(
    name="zerotrain_quantize",
    sources=("csrc/quantize/quantize.cpp",),
    include_dirs=("csrc/includes",),  # simd.h and isa.h, shared with the Adam op
    cflags=("-O3", "-fopenmp", "-Wno-psabi"),
    ldflags=("-fopenmp",),
    isa_env="ZEROTRAIN_QUANTIZE_ISA",
    fallback="zerotrain.ops.quantize_reference",
)

QUANTIZE_CUDA = OpSpec(
    name="zerotrain_quantize_cuda",
    sources=("csrc/quantize/quantize.cu",),
    cflags=("-O3",),
    cuda_cflags=("-O3",),
    cuda=True,
    is_python_module=False,
    build_estimate_s=120,
    fallback="zerotrain.ops.quantize_reference",
)

HOST_CACHE = OpSpec(
    name="zerotrain_host_cache",
    sources=("csrc/host_cache/host_cache.cpp",),
    cflags=("-O2",),
    build_estimate_s=45,
    fallback="torch's own CPU allocator (zerotrain.ops.host_cache)",
)

ALL_OPS = (CPU_ADAM, FUSED_ADAM_CUDA, QUANTIZE, QUANTIZE_CUDA, HOST_CACHE)


@dataclass
class _Loaded:
    module: Optional[ModuleType]
    error: Optional[str] = None
    build_dir: Optional[str] = None


_LOCK = threading.Lock()
_CACHE: dict[str, _Loaded] = {}


def build_policy() -> str:
    """'lazy' (default), 'strict' ($ZEROTRAIN_BUILD_OPS=1) or 'off' ($ZEROTRAIN_BUILD_OPS=0)."""
    value = os.environ.get(BUILD_POLICY_ENV, "").strip().lower()
    if value in ("", "auto", "lazy"):
        return "lazy"
    if value in ("1", "true", "yes", "strict"):
        return "strict"
    if value in ("0", "false", "no", "off"):
        return "off"
    raise ValueError(
        f"{BUILD_POLICY_ENV}={value!r} is not understood; use 1 (build, fail loudly), "
        "0 (never build, use the torch fallback) or leave it unset (build on first use)"
    )


def extensions_dir() -> str:
    """The cache folder for this Python, torch and machine (see the module docstring)."""
    root = os.environ.get(CACHE_DIR_ENV)
    if not root:
        cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(cache_home, "zerotrain", "extensions")
    tag = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}_{platform.machine()}"
    return os.path.join(root, re.sub(r"[^A-Za-z0-9_.]+", "_", tag))


def source_digest(spec: OpSpec) -> str:
    """12 hex digits of a hash of the op's input files (names and contents) and build flags."""
    h = hashlib.sha256()
    flags = [_LAYOUT_VERSION, spec.name, spec.cflags, spec.ldflags, spec.cuda_cflags, spec.cuda,
             spec.is_python_module, spec.include_dirs]
    h.update(repr(flags).encode())
    for rel in spec.input_files():
        with open(os.path.join(spec.root_dir, rel), "rb") as f:
            data = f.read()
        h.update(f"\0{rel}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()[:12]


def build_dir(spec: OpSpec) -> str:
    """The folder this op's sources build into: ``<extensions_dir()>/<name>-<digest>``."""
    return os.path.join(extensions_dir(), f"{spec.name}-{source_digest(spec)}")


def library_path(spec: OpSpec, directory: Optional[str] = None) -> str:
    """Where the built ``.so`` lies (it may not exist)."""
    return os.path.join(directory or build_dir(spec), f"{spec.name}.so")


def is_built(spec: OpSpec, directory: Optional[str] = None) -> bool:
    directory = directory or build_dir(spec)
    return os.path.exists(os.path.join(directory, BUILT_MARKER)) and os.path.exists(
        library_path(spec, directory))

# --------------------------------------------------------------------------------------------
# Building and loading
# --------------------------------------------------------------------------------------------
def _missing_toolchain(spec: OpSpec) -> Optional[str]:
    """Why this op cannot be compiled here, or None."""
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler found (looked for {cxx!r}; set $CXX)"
    if spec.cuda:
        if not torch.cuda.is_available():
            return "torch has no usable CUDA device"
        if cpp_extension.CUDA_HOME is None:
            return "CUDA toolkit not found (set $CUDA_HOME)"
    return None


def _load_built(spec: OpSpec, directory: str) -> Any:
    """Load a finished build's ``.so`` without ninja."""
    path = library_path(spec, directory)
    if not spec.is_python_module:
        torch.ops.load_library(path)
        return torch.ops.zerotrain
    mod_spec = importlib.util.spec_from_file_location(spec.name, path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module


def _stage_sources(spec: OpSpec, directory: str) -> str:
    """Copy the op's input files into ``<directory>/src`` (same relative layout); return it."""
    src = os.path.join(directory, "src")
    for rel in spec.input_files():
        origin, dest = os.path.join(spec.root_dir, rel), os.path.join(src, rel)
        if not (os.path.exists(dest) and filecmp.cmp(origin, dest, shallow=False)):
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            shutil.copyfile(origin, dest)  # unchanged files keep their mtime: ninja skips them
    return src


def _compile(spec: OpSpec) -> tuple[Any, str]:
    directory = build_dir(spec)
    if is_built(spec, directory):
        return _load_built(spec, directory), directory
    from torch.utils import cpp_extension

    with build_lock(directory, spec.name):
        if is_built(spec, directory):  # another process built it while we waited
            return _load_built(spec, directory), directory
        _say(f"zerotrain: compiling op {spec.name} into {directory} (takes about "
             f"{spec.build_estimate_s} s, once; build ahead with `zerotrain-build-ops`)")
        src = _stage_sources(spec, directory)
        t0 = time.monotonic()
        module = cpp_extension.load(
            name=spec.name,
            sources=[os.path.join(src, s) for s in spec.sources],
            extra_cflags=list(spec.cflags),
            extra_cuda_cflags=list(spec.cuda_cflags) or None,
            extra_ldflags=list(spec.ldflags),
            extra_include_paths=[os.path.join(src, s) for s in spec.include_dirs],
            build_directory=directory,
            with_cuda=spec.cuda,
            is_python_module=spec.is_python_module,
            verbose=log.isEnabledFor(logging.DEBUG),
        )
        with open(os.path.join(directory, BUILT_MARKER), "w", encoding="utf-8") as f:
            f.write(f"built in {time.monotonic() - t0:.1f} s by pid {os.getpid()}\n")
    if not spec.is_python_module:  # the library registered its ops on load
        module = torch.ops.zerotrain
    return module, directory


def _first_line(text: str, limit: int = 300) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    first = lines[0] if lines else text
    return first if len(first) <= limit else first[:limit] + "..."


def load_op(spec: OpSpec, *, strict: Optional[bool] = None) -> Any:
    """The compiled op, building it if needed; None if it cannot be had (after ONE warning).

    ``strict`` (default: ``$ZEROTRAIN_BUILD_OPS=1``) raises instead of returning None.
    """
    policy = build_policy()
    strict = policy == "strict" if strict is None else strict
    with _LOCK:
        cached = _CACHE.get(spec.name)
        if cached is not None and (cached.module is not None or not strict):
            return cached.module
        if policy == "off" and not strict:
            _CACHE[spec.name] = _Loaded(None, f"disabled by {BUILD_POLICY_ENV}=0")
            return None
        reason = _missing_toolchain(spec)
        if reason is None:
            try:
                module, directory = _compile(spec)
                _CACHE[spec.name] = _Loaded(module, None, directory)
                return module
            except Exception as exc:  # noqa: BLE001 - any build/load failure means "fall back"
                if strict:
                    raise
                what = "waiting for its build timed out" if isinstance(exc, BuildLockTimeout) \
                    else "the build failed"
                reason = f"{what}: {type(exc).__name__}: {exc}"
        elif strict:
            raise RuntimeError(f"cannot build zerotrain op {spec.name!r}: {reason}")
        _CACHE[spec.name] = _Loaded(None, reason)
    warnings.warn(
        f"zerotrain: native op {spec.name!r} is unavailable ({_first_line(reason)}); using the "
        "pure-torch fallback, which is correct but makes extra passes over memory. Full reason: "
        f"zerotrain.ops.kernel_info()['error']. Set {BUILD_POLICY_ENV}=0 to use the fallback "
        f"without this warning, or {BUILD_POLICY_ENV}=1 to make it an error.",
        RuntimeWarning,
        stacklevel=4,  # load_op <- cpu_adam_module <- fused_adam_step <- the caller
    )
    return None


def load_error(spec: OpSpec) -> Optional[str]:
    """Why the last :func:`load_op` of this op returned None (None if it loaded or never ran)."""
    cached = _CACHE.get(spec.name)
    return cached.error if cached is not None else None


def loaded_module(spec: OpSpec) -> Optional[ModuleType]:
    """The op if this process has already loaded it, else None (never builds)."""
    cached = _CACHE.get(spec.name)
    return cached.module if cached is not None else None


def build_dir_of(spec: OpSpec) -> str:
    cached = _CACHE.get(spec.name)
    if cached is not None and cached.build_dir:
        return cached.build_dir
    return build_dir(spec)


def reset_cache() -> None:
    """Forget loaded ops and warnings in this process (tests; a rebuilt op needs a new process)."""
    with _LOCK:
        _CACHE.clear()


def cpu_adam_module() -> Optional[ModuleType]:
    return load_op(CPU_ADAM)


def quantize_module() -> Optional[ModuleType]:
    return load_op(QUANTIZE)


def host_cache_module() -> Optional[ModuleType]:
    return load_op(HOST_CACHE)


def build_all() -> dict[str, str]:
    """Build every op that applies to this machine, raising on failure.

    Returns ``{op name: build folder, or "skipped: <reason>"}``. The CUDA op is skipped (not an
    error) where torch sees no GPU or no CUDA toolkit.
    """
    result: dict[str, str] = {}
    for spec in ALL_OPS:
        if spec.cuda:
            reason = _missing_toolchain(spec)
            if reason is not None:
                result[spec.name] = f"skipped: {reason}"
                continue
        with _LOCK:
            _CACHE.pop(spec.name, None)
        load_op(spec, strict=True)
        result[spec.name] = build_dir_of(spec)
    return result
