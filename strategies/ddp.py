"""Data parallelism with torch's DistributedDataParallel: the baseline every other strategy is
measured against. Gradients are all-reduced in buckets during backward; each rank keeps the whole
model and optimizer."""
from __future__ import annotations

import contextlib

from torch.nn.parallel import DistributedDataParallel

from .base import StepWrapper, Strategy


class DDP(Strategy):
    name = "ddp"

    def __init__(self, bucket_cap_mb: float = 25.0, find_unused_parameters: bool = False,
                 gradient_as_bucket_view: bool = True, static_graph: bool = False,
                 process_group_timeout_s: float = 300.0) -> None:
        super().__init__(process_group_timeout_s=process_group_timeout_s)
        if bucket_cap_mb <= 0:
            raise ValueError(f"DDP: bucket_cap_mb={bucket_cap_mb!r} must be > 0")
        self.bucket_cap_mb = bucket_cap_mb
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph

    def setup_module(self, module) -> None:
        super().setup_module(module)
        if not self.distributed:
            return  # one process: DDP would only add overhead
        ids = [self.device.index] if self.device.type == "cuda" else None
        self.model = DistributedDataParallel(
            StepWrapper(self.module), device_ids=ids, bucket_cap_mb=self.bucket_cap_mb,
            find_unused_parameters=self.find_unused_parameters,
            gradient_as_bucket_view=self.gradient_as_bucket_view, static_graph=self.static_graph)

    def no_sync(self):
        if isinstance(self.model, DistributedDataParallel):
            return self.model.no_sync()
        return contextlib.nullcontext()
