"""Moving gradients to the optimizer and updated parameters back: the one place that knows
whether the working parameters live in host memory or on a GPU.

:class:`HostWorking` (CPU training): the gradient partitions *are* host memory, so the kernel reads
them in place, and it writes the bf16/fp16 working copy straight into the working partition
(``param_out``) in the same pass. In fp32 with RAM-resident masters the master *is* the working
partition and nothing is copied at all.

:class:`DeviceWorking` (GPU training; written for CUDA, not run on the CPU-only CI machine):

* during the synchronising backward, each reduced piece of this rank's gradient partition is
  copied device -> host (pinned) on a side stream as soon as its bucket lands (``stream_grad``,
  wired to the stage's ``on_reduced`` callback), so the copies run while backward continues;
* the optimizer waits for those copies once (``grads_ready``), then steps sub-group by sub-group;
  after each sub-group its new working values go host -> device on the side stream
  (``after_step``), overlapping the CPU step of the next sub-group;
* ``finish`` makes the compute stream wait for the uploads before the parameter all-gather.

Host copies of the gradient are not unscaled by the precision plugin (it unscales the device
partitions), so :meth:`DeviceWorking.host_grad_scale` returns the loss scale they still carry and
the strategy folds its inverse into the kernel's ``grad_scale``.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .plan import SubGroup


class _HostBuffers:
    """What the stepper sees in both cases: host gradients to read (``host_grads``, one per slot)
    and host buffers the kernel writes the low-precision working copy into (``host_out``)."""

    host_grads: list[torch.Tensor]
    host_out: list[torch.Tensor]

    def grad(self, sg: SubGroup) -> torch.Tensor:
        return self.host_grads[sg.slot][sg.lo:sg.hi]

    def slot_grad(self, slot: int) -> torch.Tensor:
        return self.host_grads[slot]

    def host_grads_of(self, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The host copies of the slots whose stage-side gradient is among ``grads`` (one
        optimizer's, when several step separately)."""
        wanted = {(g.data_ptr(), g.numel()) for g in grads}
        return [h for h, src in zip(self.host_grads, self.sources())
                if (src.data_ptr(), src.numel()) in wanted]

    def sources(self) -> list[torch.Tensor]:
        """The stage-side gradient of each slot."""
        raise NotImplementedError

    def param_out(self, sg: SubGroup, master: torch.Tensor) -> torch.Tensor | None:
        """Where the kernel writes the low-precision working copy (None: fp32, see after_step; or
        a 16-bit master, which is the working copy itself)."""
        out = self.host_out[sg.slot]
        if out.dtype == torch.float32 or out[sg.lo:sg.hi].data_ptr() == master.data_ptr():
            return None
        return out[sg.lo:sg.hi]


class HostWorking(_HostBuffers):
    def __init__(self, working: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
        self.working = list(working)  # the working values of each slot (bf16/fp16/fp32)
        self.host_grads = list(grads)  # the reduced gradient of each slot, read in place
        self.host_out = self.working  # the kernel writes the working partitions directly
        self.device = torch.device("cpu")

    def host_grad_scale(self, loss_scale: float) -> float:
        """The loss scale the gradients the stepper reads still carry: none, they are the
        partitions the precision plugin unscaled in place."""
        return 1.0

    def grads_ready(self) -> None:
        pass

    def after_step(self, sg: SubGroup, master: torch.Tensor) -> None:
        w = self.working[sg.slot][sg.lo:sg.hi]
        if w.dtype == torch.float32 and w.data_ptr() != master.data_ptr():
            w.copy_(master)

    def finish(self) -> None:
        pass

    def load_working(self, slot: int, master: torch.Tensor) -> None:
        w = self.working[slot]
        if w.data_ptr() != master.data_ptr():
            w.copy_(master)

    def sources(self) -> list[torch.Tensor]:
        return self.host_grads

    def buffers(self) -> list[torch.Tensor]:
        return []


class DeviceWorking(_HostBuffers):
    def __init__(self, working: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], pin: bool) -> None:
        self.working, self.device_grads = list(working), list(grads)
        self.device = self.working[0].device if self.working else torch.device("cuda")
        self.stream = torch.cuda.Stream(device=self.device)
        self.host_grads = [torch.zeros(g.numel(), dtype=g.dtype, pin_memory=pin) for g in self.device_grads]
        self.staging = [torch.empty(w.numel(), dtype=w.dtype, pin_memory=pin) for w in self.working]
        self.host_out = self.staging  # uploaded to the working partitions in after_step

    def stream_grad(self, slot: int, start: int, numel: int) -> None:
        """Start copying a just-reduced piece of a slot's gradient to the host."""
        self.stream.wait_stream(torch.cuda.current_stream())  # after the reduction's add_
        with torch.cuda.stream(self.stream):
            self.host_grads[slot][start:start + numel].copy_(
                self.device_grads[slot][start:start + numel], non_blocking=True)

    def host_grad_scale(self, loss_scale: float) -> float:
        """The loss scale the host copies still carry: all of it (``loss_scale``, what backward
        multiplied the loss by), as they were copied before the plugin unscaled the device
        partitions."""
        return loss_scale

    def grads_ready(self) -> None:
        self.stream.synchronize()

    def after_step(self, sg: SubGroup, master: torch.Tensor) -> None:
        host = self.staging[sg.slot][sg.lo:sg.hi]
        if host.dtype == torch.float32:
            host.copy_(master)  # the master may be a swap buffer, reused before the upload ends
        with torch.cuda.stream(self.stream):
            self.working[sg.slot][sg.lo:sg.hi].copy_(host, non_blocking=True)

    def finish(self) -> None:
        torch.cuda.current_stream().wait_stream(self.stream)

    def load_working(self, slot: int, master: torch.Tensor) -> None:
        self.working[slot].copy_(master.to(self.working[slot].device))

    def sources(self) -> list[torch.Tensor]:
        return self.device_grads

    def buffers(self) -> list[torch.Tensor]:
        return [*self.host_grads, *self.staging]
