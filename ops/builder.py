"""Builds and loads zerotrain's compiled ops, once, into a cache that outlives the process.

Each op is a small frozen :class:`OpSpec` (sources, flags). :func:`load_op` compiles it with
``torch.utils.cpp_extension.load`` on first use, into::

    $ZEROTRAIN_EXTENSIONS_DIR/<tag>/<op name>/          if the variable is set, else
    ~/.cache/zerotrain/extensions/<tag>/<op name>/      ($XDG_CACHE_HOME replaces ~/.cache)

where ``<tag>`` names the Python and torch versions, so an upgrade never loads a stale binary.
``cpp_extension.load`` hashes the sources and flags and reruns ninja, which rebuilds only what
changed; a second process, or a second run, just loads the ``.so`` (well under a second). A lock
file in the build folder makes concurrent ranks wait for one build instead of racing.

No ``-march=native``: the CPU kernel picks its SIMD path at run time (see csrc/adam/cpu_adam.cpp),
so a cache built on one machine serves any x86-64 CPU with the same Python and torch.

``$ZEROTRAIN_BUILD_OPS`` chooses the policy:

* unset: build on first use; if the toolchain is missing or the build fails, warn once and use
  the pure-torch fallback (:mod:`zerotrain.ops.reference`).
* ``1``: strict; a failed build raises. Build ahead of time (for example in a container image)
  with ``ZEROTRAIN_BUILD_OPS=1 python -c "import zerotrain.ops; zerotrain.ops.build_all()"``.
* ``0``: never compile; always use the fallback, silently.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import sys
import threading
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Optional

import torch

log = logging.getLogger(__name__)

# The package root (zerotrain/), which holds csrc/.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD_POLICY_ENV = "ZEROTRAIN_BUILD_OPS"
CACHE_DIR_ENV = "ZEROTRAIN_EXTENSIONS_DIR"


@dataclass(frozen=True)
class OpSpec:
    """What to compile for one op: a build descriptor, nothing more."""

    name: str
    sources: tuple[str, ...]  # relative to the package root
    include_dirs: tuple[str, ...] = ()
    cflags: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()
    cuda_cflags: tuple[str, ...] = ()
    cuda: bool = False
    # False: a plain shared library that registers torch ops (torch.ops.zerotrain.*) on load;
    # load_op then returns the torch.ops.zerotrain namespace.
    is_python_module: bool = True

    def absolute_sources(self) -> list[str]:
        return [os.path.join(_ROOT, s) for s in self.sources]

    def absolute_includes(self) -> list[str]:
        return [os.path.join(_ROOT, s) for s in self.include_dirs]


CPU_ADAM = OpSpec(
    name="zerotrain_cpu_adam",
    sources=("csrc/adam/cpu_adam.cpp",),
    include_dirs=("csrc/includes",),
    # -Wno-psabi: vector arguments cross functions with different target attributes by design.
    cflags=("-O3", "-fopenmp", "-Wno-psabi"),
    ldflags=("-fopenmp",),
)

FUSED_ADAM_CUDA = OpSpec(
    name="zerotrain_fused_adam_cuda",
    sources=("csrc/adam/fused_adam.cu",),
    cflags=("-O3",),
    cuda_cflags=("-O3",),
    cuda=True,
    is_python_module=False,
)

ALL_OPS = (CPU_ADAM, FUSED_ADAM_CUDA)


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
    """The root of the build cache (see the module docstring)."""
    root = os.environ.get(CACHE_DIR_ENV)
    if not root:
        cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(cache_home, "zerotrain", "extensions")
    torch_tag = re.sub(r"[^A-Za-z0-9_.]+", "_", torch.__version__)
    tag = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch_tag}"
    return os.path.join(root, tag)


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


def _compile(spec: OpSpec) -> tuple[Any, str]:
    from torch.utils import cpp_extension

    build_dir = os.path.join(extensions_dir(), spec.name)
    os.makedirs(build_dir, exist_ok=True)
    module = cpp_extension.load(
        name=spec.name,
        sources=spec.absolute_sources(),
        extra_cflags=list(spec.cflags),
        extra_cuda_cflags=list(spec.cuda_cflags) or None,
        extra_ldflags=list(spec.ldflags),
        extra_include_paths=spec.absolute_includes(),
        build_directory=build_dir,
        with_cuda=spec.cuda,
        is_python_module=spec.is_python_module,
        verbose=log.isEnabledFor(logging.DEBUG),
    )
    if not spec.is_python_module:  # the library registered its ops on load
        module = torch.ops.zerotrain
    return module, build_dir


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
                module, build_dir = _compile(spec)
                _CACHE[spec.name] = _Loaded(module, None, build_dir)
                return module
            except Exception as exc:  # noqa: BLE001 - any build/load failure means "fall back"
                if strict:
                    raise
                reason = f"the build failed: {type(exc).__name__}: {exc}"
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


def build_dir_of(spec: OpSpec) -> str:
    cached = _CACHE.get(spec.name)
    if cached is not None and cached.build_dir:
        return cached.build_dir
    return os.path.join(extensions_dir(), spec.name)


def reset_cache() -> None:
    """Forget loaded ops and warnings in this process (tests; a rebuilt op needs a new process)."""
    with _LOCK:
        _CACHE.clear()


def cpu_adam_module() -> Optional[ModuleType]:
    return load_op(CPU_ADAM)


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
