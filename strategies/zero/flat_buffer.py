"""Working parameters of one param group as views into one flat, padded buffer.

``flatten_group`` moves a group's parameters into a new flat buffer in the working dtype and makes
each ``Parameter`` a view of it (the ``Parameter`` objects stay the same, so references the user
holds keep working). The buffer's layout is a :class:`~.layout.GroupLayout`, so rank r's partition
is the contiguous range ``[r * P, (r + 1) * P)``, and refreshing the parameters after a step is a
plain all-gather of every rank's partition into this buffer.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from .comm import InFlight, InFlightQueue, all_gather_into, broadcast_from
from .layout import GroupLayout, partition_chunks


class FlatParamGroup:
    def __init__(self, params: Sequence[nn.Parameter], layout: GroupLayout, flat: torch.Tensor) -> None:
        if len(params) != len(layout.spans):
            raise ValueError(f"{len(params)} parameters but the layout has {len(layout.spans)} spans")
        if flat.numel() != layout.padded_numel:
            raise ValueError(f"flat buffer has {flat.numel()} elements, layout needs {layout.padded_numel}")
        self.params = list(params)
        self.layout = layout
        self.flat = flat

    @property
    def dtype(self) -> torch.dtype:
        return self.flat.dtype

    def view(self, index: int, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """Parameter ``index``'s region of ``buffer`` (default: the working buffer), in its shape."""
        span = self.layout.spans[index]
        buf = self.flat if buffer is None else buffer
        return buf[span.offset:span.end].view(self.params[index].shape)

    def bind(self) -> None:
        """Point every parameter's data at its region of the flat buffer."""
        for i, p in enumerate(self.params):
            p.data = self.view(i)

    def partition(self, rank: int, buffer: torch.Tensor | None = None) -> torch.Tensor:
        lo, hi = self.layout.partition_range(rank)
        return (self.flat if buffer is None else buffer)[lo:hi]

    def gather_from(self, master: torch.Tensor, rank: int, bucket_numel: int, queue: InFlightQueue,
                    group: object = None) -> None:
        """Collective: write every rank's (updated) master slice into this working buffer.

        Chunks of at most ``bucket_numel`` elements (all ranks together) go through
        ``all_gather_into_tensor``; a single chunk lands in the working buffer directly, several go
        through a staging buffer and are copied to their ranks' places."""
        layout, world = self.layout, self.layout.world_size
        p = layout.partition_numel
        if p == 0:
            return
        chunks = partition_chunks(p, world, bucket_numel)
        shares_storage = master.untyped_storage().data_ptr() == self.flat.untyped_storage().data_ptr()
        for s, e in chunks:
            src = master[s:e].to(self.flat.dtype)
            if shares_storage:  # fp32: the master slice *is* this rank's part of the output
                src = src.clone()
            if len(chunks) == 1:
                handle = all_gather_into(self.flat, src, group)
                queue.push(InFlight((handle,), (src,), _nothing, "all_gather params"))
                continue
            n = e - s
            staging = torch.empty(world * n, dtype=self.flat.dtype, device=self.flat.device)
            handle = all_gather_into(staging, src, group)

            def scatter_out(staging=staging, s=s, n=n) -> None:
                for r in range(world):
                    self.flat[r * p + s:r * p + s + n].copy_(staging[r * n:(r + 1) * n])

            queue.push(InFlight((handle,), (src, staging), scatter_out, "all_gather params"))
        queue.wait_all()


def _nothing() -> None:
    pass


def flatten_group(params: Sequence[nn.Parameter], layout: GroupLayout, dtype: torch.dtype, rank: int,
                  queue: InFlightQueue, group: object = None) -> tuple[FlatParamGroup, torch.Tensor]:
    """Collective: move ``params`` into a new flat buffer of ``dtype`` holding rank 0's values
    (broadcast, as DDP does at start) and return it with this rank's fp32 master slice.

    In fp32 the master slice is a view of the working buffer (no second copy of the owned
    elements); otherwise it is an fp32 copy taken before the cast, so masters start exact."""
    device = params[0].device if params else torch.device("cpu")
    full = torch.zeros(layout.padded_numel, dtype=torch.float32, device=device)
    for p, span in zip(params, layout.spans):
        full[span.offset:span.end].copy_(p.detach().reshape(-1))
    if full.numel():
        queue.push(InFlight((broadcast_from(full, 0, group),), (full,), _nothing, "broadcast params"))
        queue.wait_all()
    lo, hi = layout.partition_range(rank)
    if dtype == torch.float32:
        flat, master = full, full[lo:hi]
    else:
        flat, master = full.to(dtype), full[lo:hi].clone()
    fg = FlatParamGroup(params, layout, flat)
    fg.bind()
    return fg, master
