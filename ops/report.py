"""``zerotrain-build-ops`` and ``zerotrain-report``: build the compiled ops ahead of time, and say
what this machine would run (like DeepSpeed's ``ds_report``).

    zerotrain-build-ops               # or: python -m zerotrain.ops.report --build
    zerotrain-report                  # or: python -m zerotrain.ops.report

The report never compiles: it loads an op only if it is already built. It prints the matmul peak
per process in fp32 and bf16 that MFU is taken against (``peak.py``: probed once per machine, a
second or so, then cached).
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
from typing import Optional, Sequence

import torch

from . import builder, peak
from .providers import apex_fused_adam_available

ISA_ENV = "ZEROTRAIN_ADAM_ISA"


def main_build(argv: Optional[Sequence[str]] = None) -> int:
    """Build every op that applies here; print each op's folder or why it was skipped.

    Returns 0 if every applicable op built, 1 if one failed (or the CPU op has no toolchain).
    The CUDA op is skipped, not failed, where there is no GPU or no CUDA toolkit.
    """
    argparse.ArgumentParser(prog="zerotrain-build-ops", description=main_build.__doc__).parse_args(argv)
    rc = 0
    for spec in builder.ALL_OPS:
        missing = builder._missing_toolchain(spec)
        if missing is not None:
            print(f"{spec.name}: skipped ({missing})", flush=True)
            rc = rc if spec.cuda else 1
            continue
        try:
            builder.load_op(spec, strict=True)
        except Exception as exc:  # noqa: BLE001 - report every op, then fail
            print(f"{spec.name}: FAILED: {type(exc).__name__}: {exc}", flush=True)
            rc = 1
            continue
        print(f"{spec.name}: built in {builder.build_dir_of(spec)}", flush=True)
    return rc


def cpu_isas() -> list[str]:
    """The SIMD paths the CPU kernel can take here, best first (mirrors cpu_has() in
    csrc/adam/cpu_adam.cpp, read from /proc/cpuinfo, so it needs no build)."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return ["scalar"]
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        return ["scalar"]
    isas = []
    avx2 = {"avx2", "fma", "f16c"} <= flags
    if avx2 and "avx512f" in flags:
        isas.append("avx512")
    if avx2:
        isas.append("avx2")
    return isas + ["scalar"]


def _isa_line(supported: list[str], selected: Optional[str], source: str, isa_env: str = ISA_ENV) -> str:
    override = os.environ.get(isa_env, "")
    if selected is None:  # predict what resolve_isa() would do
        if override in ("", "auto"):
            selected = supported[0]
        elif override in supported:
            selected = override
        else:
            selected = f"error: {isa_env}={override!r} is not one of {', '.join(supported)}"
    env = f"{isa_env}={override}" if override else f"{isa_env} unset"
    return f"{selected} (supported: {', '.join(supported)}; {env}; {source})"


def _op_lines(spec: builder.OpSpec, policy: str) -> list[str]:
    folder = builder.build_dir(spec)
    built = builder.is_built(spec, folder)
    missing = builder._missing_toolchain(spec)
    fallback = (f"the pure-torch reference ({spec.fallback})" if not spec.cuda
                else f"the pure-torch reference, per tensor ({spec.fallback})")
    if built and policy != "off":
        uses = "the native kernel (built)"
    elif policy == "off":
        uses = f"{fallback}: {builder.BUILD_POLICY_ENV}=0"
    elif missing is not None:
        uses = f"{fallback}: {missing}"
    elif policy == "strict":
        uses = f"the native kernel, compiled on first use (~{spec.build_estimate_s} s; a failure raises)"
    else:
        uses = (f"the native kernel, compiled on first use (~{spec.build_estimate_s} s; if that "
                f"fails, {fallback}, after one warning)")
    lines = [
        f"op {spec.name}",
        f"  folder     {folder}",
        f"  built      {'yes' if built else 'no'}",
        f"  toolchain  {missing or 'ok'}",
    ]
    if not spec.cuda and spec.isa_env is not None:  # a SIMD kernel (the host cache has one path)
        supported, selected, source = cpu_isas(), None, "predicted from /proc/cpuinfo"
        if built:
            try:
                module = builder._load_built(spec, folder)
                supported, source = list(module.supported_isas()), "from the built kernel"
                selected = module.selected_isa("")
            except Exception as exc:  # noqa: BLE001 - e.g. a bad $ZEROTRAIN_ADAM_ISA
                selected = f"error: {builder._first_line(str(exc))}"
        lines.append(f"  ISA        {_isa_line(supported, selected, source, spec.isa_env)}")
    lines.append(f"  would use  {uses}")
    return lines


def main_report(argv: Optional[Sequence[str]] = None) -> int:
    """Print the Python/torch versions, the op cache, and for each op whether it is built, the
    ISA the CPU kernel would take, and which fallback would be used and why."""
    argparse.ArgumentParser(prog="zerotrain-report", description=main_report.__doc__).parse_args(argv)
    try:
        policy = builder.build_policy()
    except ValueError as exc:
        policy = f"invalid ({exc})"
    if torch.version.cuda is None:
        cuda = "CPU-only build"
    elif torch.cuda.is_available():
        cuda = f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s)"
    else:
        cuda = f"CUDA {torch.version.cuda}, no usable device"
    try:
        wait = f"{builder.build_timeout_s():g} s"
    except ValueError as exc:
        wait = f"invalid ({exc})"
    lines = [
        "zerotrain report",
        f"python     {platform.python_version()} ({sys.executable})",
        f"torch      {torch.__version__} ({cuda})",
        f"machine    {platform.machine()}",
        f"cache      {builder.extensions_dir()}",
        f"policy     {builder.BUILD_POLICY_ENV}={os.environ.get(builder.BUILD_POLICY_ENV, '')!r}: {policy}",
        f"build wait {wait} at most for another process's build (${builder.BUILD_TIMEOUT_ENV})",
    ]
    for spec in builder.ALL_OPS:
        lines += _op_lines(spec, policy)
    lines += _peak_lines()
    apex = apex_fused_adam_available()
    lines.append(f"apex       FusedAdam {'available' if apex else 'not available'} "
                 "(NVIDIA apex with amp_C and a CUDA device)")
    print("\n".join(lines), flush=True)
    return 0


def _peak_lines() -> list[str]:
    """The peak of one process here, per dtype (GPU: the table's; CPU: probed or cached)."""
    out = []
    for dtype in ("fp32", "bf16"):
        if torch.cuda.is_available():
            flops, where = peak.gpu_peak_flops(torch.device("cuda", 0), dtype), "the GPU table"
            shown = f"{flops / 1e12:.1f} TFLOP/s" if flops else "unknown GPU"
        else:
            flops, cached = peak.cpu_peak_flops(dtype)
            where = f"{'cached' if cached else 'measured now'} in {peak.cache_path()}"
            shown = f"{flops / 1e9:.1f} GFLOP/s ({torch.get_num_threads()} threads)"
        out.append(f"peak {dtype:<5} {shown}, {where}")
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m zerotrain.ops.report [--build]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--build" in args:
        args.remove("--build")
        return main_build(args)
    return main_report(args)


if __name__ == "__main__":
    sys.exit(main())
