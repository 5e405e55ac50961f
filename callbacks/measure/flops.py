"""FlopsProfiler: parameters, FLOPs and forward latency of every module at one training step, the
model's total and its MFU against the machine's peak.

FLOPs are torch's own count (``torch.utils.flop_counter.FlopCounterMode``: matmuls, convolutions
and attention, forward and backward, attributed to the module that ran them), plus the CPU flash
attention kernel, which torch's table lacks (counted with torch's SDPA formulas). A matmul counts
2mnk; element-wise work (norms, activations, the optimizer) is not counted, as in every MFU
convention. For a transformer the total is 6 N per token (N: the parameters of its matmuls) plus
attention's 12 L d T, the PaLM estimate (``examples/gpt.py``'s ``flops_per_token``).

The peak (``ops/peak.py``): on CUDA from a table of known GPUs (dense tensor-core numbers for the
precision's compute dtype; fp32 without TF32 unless torch allows TF32), on CPU a matmul probe in
the precision's compute dtype (per process, with the threads it has), measured once per machine and
cached. MFU = the counted step's FLOPs / the
latency of the step after it (timed without the counter) / peak, per rank. Latency per module is
its forward in that step (hooks around it; the step's latency also holds backward and the
optimizer step); on CUDA the device is synchronised around each module in that step only.
"""
from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn
from torch.utils import flop_counter

from ...ops.peak import peak_flops
from ..base import Callback

def _cpu_flash(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return flop_counter.sdpa_flop_count(query, key, value)


def _cpu_flash_backward(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None,
                        **kwargs: Any) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out, query, key, value)


def _custom_mapping() -> dict[Any, Any]:
    aten = torch.ops.aten
    out = {}
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        out[aten._scaled_dot_product_flash_attention_for_cpu] = _cpu_flash
        out[aten._scaled_dot_product_flash_attention_for_cpu_backward] = _cpu_flash_backward
    return out


def compute_dtype(precision: Any) -> str:
    dtype = getattr(precision, "autocast_dtype", None) or getattr(precision, "param_dtype", torch.float32)
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


class FlopsProfiler(Callback):
    """Count the FLOPs of the training step that starts at ``global_step == profile_step`` (all
    its micro-batches), and time the next one (the counter's Python dispatch slows the step it
    counts; when fit ends first, the counted step's latency is used). ``peak_flops``: the machine's peak per process (None: the known GPU's, or
    the CPU calibration); ``depth``: how deep the printed module tree goes. After it ran,
    ``profile`` holds ``total_flops``, ``latency_s``, ``flops_per_s``, ``peak_flops``, ``mfu`` and
    ``modules`` (name -> params, flops, forward_latency_s)."""

    def __init__(self, profile_step: int = 1, peak_flops: float | None = None, depth: int = 3,
                 print_profile: bool = True) -> None:
        if isinstance(profile_step, bool) or not isinstance(profile_step, int) or profile_step < 0:
            raise ValueError(f"FlopsProfiler: profile_step={profile_step!r}; valid: an integer >= 0")
        self.profile_step, self.peak_flops, self.depth, self.print_profile = profile_step, peak_flops, depth, \
            print_profile
        self.profile: dict[str, Any] = {}
        self._mode: flop_counter.FlopCounterMode | None = None
        self._state = "idle"  # -> counting (profile_step) -> counted -> timing (the next step) -> done
        self._counts: dict[str, int] = {}
        self._latency_counted = 0.0
        self._hooks: list[Any] = []
        self._latency: dict[str, float] = {}
        self._started: dict[str, list[float]] = {}
        self._t0 = 0.0
        self._device = torch.device("cpu")

    def on_fit_start(self, trainer, pl_module) -> None:
        self._device = trainer.strategy.device
        if self.peak_flops is None:
            self.peak_flops = peak_flops(self._device, compute_dtype(trainer.precision_plugin),
                                         store=trainer.world_size == 1)  # a job's ranks probe at once: not cached

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = trainer.global_step
        if self._state == "idle" and step == self.profile_step:
            self._count(pl_module)
        elif self._state == "counted" and step == self.profile_step + 1:
            self._time(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if self._state == "counting" and step > self.profile_step:
            self._stop_counting()
        elif self._state == "timing" and step > self.profile_step + 1:
            self._finish(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        if self._state in ("counted", "timing"):  # fit ended before a plain step was timed
            self._finish(trainer, pl_module)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        self._remove_hooks()

    # ---------------------------------------------------------------- the profiled steps
    def _count(self, module: nn.Module) -> None:
        """Step ``profile_step``: count FLOPs (the counter slows the step: it is not timed)."""
        self._state = "counting"
        self._mode = flop_counter.FlopCounterMode(display=False, custom_mapping=_custom_mapping())
        _name_modules(self._mode, module)
        self._mode.__enter__()
        self._sync()
        self._t0 = time.perf_counter()

    def _stop_counting(self) -> None:
        self._sync()
        self._latency_counted = time.perf_counter() - self._t0
        mode, self._mode = self._mode, None
        mode.__exit__(None, None, None)
        self._counts = {k: sum(v.values()) for k, v in mode.get_flop_counts().items()}
        self._state = "counted"

    def _time(self, module: nn.Module) -> None:
        """The next step, without the counter: its latency and each module's forward latency."""
        self._state = "timing"
        self._latency, self._started = {}, {}
        for name, m in module.named_modules():
            self._hooks.append(m.register_forward_pre_hook(self._pre(name)))
            self._hooks.append(m.register_forward_hook(self._post(name)))
        self._sync()
        self._t0 = time.perf_counter()

    def _finish(self, trainer, module: nn.Module) -> None:
        self._sync()
        timed = self._state == "timing"
        latency = time.perf_counter() - self._t0 if timed else self._latency_counted
        self._remove_hooks()
        self._state = "done"
        total = self._counts.get("Global", 0)
        flops = {**self._counts, "": total}
        modules = {name: {"params": sum(p.numel() for p in m.parameters()), "flops": flops.get(name, 0),
                          "forward_latency_s": self._latency.get(name, 0.0)}
                   for name, m in module.named_modules()}
        rate = total / latency if latency else 0.0
        self.profile = {"total_flops": total, "latency_s": latency, "latency_timed_without_counter": timed,
                        "flops_per_s": rate, "peak_flops": self.peak_flops,
                        "mfu": rate / self.peak_flops if self.peak_flops else None, "modules": modules}
        if self.print_profile and trainer.is_global_zero:
            print(format_profile(self.profile, self.depth))

    def _pre(self, name: str):
        def hook(mod: nn.Module, args: Any) -> None:
            self._sync()
            self._started.setdefault(name, []).append(time.perf_counter())
        return hook

    def _post(self, name: str):
        def hook(mod: nn.Module, args: Any, out: Any) -> None:
            self._sync()
            stack = self._started.get(name)
            if stack:
                self._latency[name] = self._latency.get(name, 0.0) + time.perf_counter() - stack.pop()
        return hook

    def _sync(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _name_modules(mode: flop_counter.FlopCounterMode, module: nn.Module) -> None:
    """Make the flop counter name ``module``'s submodules as ``named_modules()`` does. Its module
    tracker names modules from the outermost one it sees run (a DDP or strategy wrapper, whose
    names depend on the strategy); pre-seeding its table (a private one: on a torch without it
    the per-module FLOPs stay 0, the total is unaffected) gives every strategy the same names."""
    tracker = getattr(mode, "mod_tracker", None)
    known, seen = getattr(tracker, "_known_modules", None), getattr(tracker, "_seen_modules", None)
    if known is None or seen is None:
        return
    for name, m in module.named_modules():
        if name:
            known[m] = name
        seen.add(m)


def format_profile(profile: dict[str, Any], depth: int) -> str:
    mfu = f"{profile['mfu']:.1%}" if profile["mfu"] is not None else "unknown (no peak for this device)"
    peak = f"{profile['peak_flops'] / 1e12:.3f} TFLOP/s" if profile["peak_flops"] else "unknown"
    lines = [f"FlopsProfiler: {profile['total_flops'] / 1e9:.3f} GFLOPs in {profile['latency_s'] * 1e3:.1f} ms "
             f"({profile['flops_per_s'] / 1e12:.4f} TFLOP/s per rank; peak {peak}; MFU {mfu})",
             f"{'module':<40}{'params':>12}{'GFLOPs':>12}{'fwd ms':>10}"]
    for name, m in profile["modules"].items():
        if name.count(".") >= depth:
            continue
        lines.append(f"{(name or '(model)'):<40}{m['params']:>12}{m['flops'] / 1e9:>12.4f}"
                     f"{m['forward_latency_s'] * 1e3:>10.2f}")
    return "\n".join(lines)
