"""The machine's matmul peak, the denominator of every MFU zerotrain reports.

* On CUDA: a table of known GPUs' dense peaks (vendor data sheets, SXM where both exist) for the
  compute dtype; fp32 is TF32's peak when torch allows TF32 matmuls.
* On CPU: measured. A probe times an ``n x n`` matmul in the dtype (fp32, bf16 or fp16) on the
  process's threads, best of three rounds, and the figure is cached per CPU model, torch version,
  torch's kernel level (``ATEN_CPU_CAPABILITY``), dtype and thread count, in
  ``$XDG_CACHE_HOME/zerotrain/peak_flops.json`` (``~/.cache`` without it; ``ZEROTRAIN_PEAK_CACHE``
  names another file), so that a machine is probed once. The file is written atomically; a
  damaged file is ignored and rewritten. ``zerotrain-report`` prints both dtypes' peaks.

A CPU probe takes the fastest of 512, 1024 and 2048 (about 1 s in all per dtype on one core; a size
whose one matmul would outlast a round is skipped); on a
CPU without native bf16 matmuls bf16 is many times slower than fp32, and that slower figure is what
a bf16 run's MFU is then taken against.
"""
from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from typing import Optional

import torch

CACHE_ENV = "ZEROTRAIN_PEAK_CACHE"

#: dense peak FLOP/s by GPU name fragment and compute dtype
KNOWN_GPUS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12},
    "H100": {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362e12, "fp16": 362e12, "tf32": 183e12, "fp32": 91.6e12},
    "L4": {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12},
    "A10": {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12},
    "RTX 4090": {"bf16": 165.2e12, "fp16": 165.2e12, "tf32": 82.6e12, "fp32": 82.6e12},
    "V100": {"fp16": 125e12, "fp32": 15.7e12},
    "T4": {"fp16": 65e12, "fp32": 8.1e12},
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def gpu_peak_flops(device: torch.device, dtype: str) -> Optional[float]:
    """The known GPU's dense peak for ``dtype`` (fp32: TF32's when torch allows it), else None."""
    name = torch.cuda.get_device_name(device)
    if dtype == "fp32" and torch.get_float32_matmul_precision() != "highest":
        dtype = "tf32"
    for fragment, peaks in KNOWN_GPUS.items():
        if fragment in name:
            return peaks.get(dtype) or peaks.get("fp16")
    return None


def probe_cpu_matmul(dtype: str = "fp32", sizes: tuple[int, ...] = (512, 1024, 2048), seconds: float = 0.3) -> float:
    """FLOP/s of the fastest ``n x n`` matmul in ``dtype`` on this process's threads, over ``sizes``:
    for each size the best of three rounds of ``seconds / 3`` each (at least one matmul a round).
    Several sizes because the fastest one differs between CPUs and BLAS libraries (on a Zen 4
    EPYC with MKL, one thread: 102 GFLOP/s at 512, 96 at 1024, 95 at 2048 and 4096)."""
    best = 0.0
    for n in sizes:
        if best and 2 * n ** 3 / best > seconds / 3:  # one matmul of this size would outlast a round
            break
        a, b = torch.randn(n, n).to(DTYPES[dtype]), torch.randn(n, n).to(DTYPES[dtype])
        torch.mm(a, b)  # warm-up: the kernel's first call packs and allocates
        for _ in range(3):
            reps, start = 0, time.perf_counter()
            while True:
                torch.mm(a, b)
                reps += 1
                elapsed = time.perf_counter() - start
                if elapsed >= seconds / 3:
                    break
            best = max(best, 2 * n ** 3 * reps / elapsed)
    return best


def cache_path() -> str:
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return explicit
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(home, "zerotrain", "peak_flops.json")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_key(dtype: str, threads: Optional[int] = None) -> str:
    threads = torch.get_num_threads() if threads is None else threads
    level = torch.backends.cpu.get_cpu_capability()
    return f"{cpu_model()} | torch {torch.__version__} | {level} | {dtype} | {threads} threads"


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write(path: str, data: dict) -> None:
    """Atomic: a temporary file in the same folder, renamed over the old one."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".peak_flops.", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        if os.path.exists(tmp):
            os.unlink(tmp)


def cpu_peak_flops(dtype: str = "fp32", *, refresh: bool = False, store: bool = True) -> tuple[float, bool]:
    """(this process's CPU matmul peak in ``dtype``, whether it came from the cache). Probes and
    caches it the first time on this machine; ``refresh`` probes again. ``store=False``: a probe
    taken beside other processes (the ranks of a job probe at once) is used, not cached, so the
    cache holds only figures measured alone (``zerotrain-report``, one-process runs). An
    unwritable cache only costs the probe next time."""
    if dtype not in DTYPES:
        raise ValueError(f"peak FLOP/s: dtype={dtype!r}; valid: {sorted(DTYPES)}")
    path, key = cache_path(), cache_key(dtype)
    data = _read(path)
    entry = data.get(key)
    if not refresh and isinstance(entry, dict) and isinstance(entry.get("flops"), (int, float)) \
            and entry["flops"] > 0:
        return float(entry["flops"]), True
    flops = probe_cpu_matmul(dtype)
    if not store:
        return flops, False
    data[key] = {"flops": flops, "measured": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
    _write(path, data)
    return flops, False


def peak_flops(device: torch.device, dtype: str, store: bool = True) -> Optional[float]:
    """The peak FLOP/s of one process on ``device`` for ``dtype``: the GPU table's (None for an
    unknown GPU), or the CPU's cached figure, else measured (and cached if ``store``)."""
    if device.type == "cuda":
        return gpu_peak_flops(device, dtype)
    return cpu_peak_flops(dtype, store=store)[0]
