"""What the kernel tests share: loading a compiled CPU op (skipping where nothing can build it),
forcing one of its SIMD paths, and compiling a CUDA source with nvcc."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch

from zerotrain.ops import builder

NVCC = shutil.which("nvcc")
ISAS = ["avx512", "avx2", "scalar"]


def load_native(spec: builder.OpSpec):
    """The compiled module; a failed build fails (not skips) wherever a toolchain exists."""
    missing = builder._missing_toolchain(spec)
    if missing is not None:
        pytest.skip(f"cannot build the native kernel here: {missing}")
    return builder.load_op(spec, strict=True)


def require_isa(native, name: str) -> str:
    """``name``, or a skip saying which paths this CPU has."""
    supported = list(native.supported_isas())
    if name not in supported:
        pytest.skip(f"this CPU lacks {name} (it supports: {', '.join(supported)})")
    return name


def native_fixtures(spec: builder.OpSpec):
    """The fixtures ``native`` (the op, module-scoped) and ``isa`` (each path in ``ISAS``, skipped
    where the CPU lacks it), for ``native, isa = native_fixtures(spec)`` in a test module."""

    @pytest.fixture(scope="module")
    def native():
        return load_native(spec)

    @pytest.fixture(params=ISAS)
    def isa(request, native):
        return require_isa(native, request.param)

    return native, isa


def torch_flags() -> list[str]:
    include = os.path.join(os.path.dirname(torch.__file__), "include")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return ["-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-I", include,
            "-I", os.path.join(include, "torch", "csrc", "api", "include"),
            "-diag-suppress", "3306"]


def assert_nvcc_compiles(source: str, tmp_path, with_torch: bool) -> None:
    """``source`` compiles: the kernels alone, or with the torch op registration against the
    installed torch headers (a CPU-only torch is enough; ~1.5-2 min on 2 cores)."""
    flags = torch_flags() if with_torch else ["-std=c++17", "-DZEROTRAIN_CUDA_NO_TORCH"]
    obj = tmp_path / (os.path.splitext(os.path.basename(source))[0] + ".o")
    cmd = [NVCC, "-c", "-O3", *flags, source, "-o", str(obj)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"
    assert obj.stat().st_size > 0
