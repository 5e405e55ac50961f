"""ZeRO-3 trains a model larger than a rank's memory budget: on 4 gloo processes, each capped
(RLIMIT_DATA) below the model's size before the model is built in ``configure_model()``."""
from __future__ import annotations

import resource
import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from harness import run_ranks
from test_zero3 import fit
from zerotrain import Callback, TrainModule
from zerotrain.strategies.zero import ZeroStage3


class MemoryCap(Callback):
    """Before the model is built: cap this process's data segment (RLIMIT_DATA: heap and private
    writable mappings, which is where torch's CPU allocations go) ``budget`` bytes above what it
    uses now, and check that an allocation of the model's full size is refused."""

    def __init__(self, budget: int, full_bytes: int) -> None:
        self.budget, self.full_bytes = budget, full_bytes
        self.saved = resource.getrlimit(resource.RLIMIT_DATA)
        self.refused = False

    def setup(self, trainer, module, stage=None):
        # one-time costs before the cap: gloo's threads, torch's lazy imports (an optimizer's
        # first construction imports torch._dynamo), autograd, the data loader, and a thread's
        # stack (8 MiB of writable mapping, which RLIMIT_DATA counts: the Trainer's progress
        # watchdog starts after the first step, and glibc hands it the cached stack of this one)
        warm_thread = threading.Thread(target=lambda: None)
        warm_thread.start()
        warm_thread.join()
        t = torch.ones(1)
        dist.all_reduce(t)
        warm = nn.Linear(2, 2)
        torch.optim.SGD(warm.parameters(), lr=0.1).step()
        warm(torch.ones(1, 2)).sum().backward()
        next(iter(DataLoader(TensorDataset(torch.ones(2, 2)), batch_size=1)))
        resource.setrlimit(resource.RLIMIT_DATA, (vm_data() + self.budget, self.saved[1]))
        try:
            torch.ones(self.full_bytes // 4)
        except RuntimeError:
            self.refused = True

    def release(self) -> None:
        resource.setrlimit(resource.RLIMIT_DATA, self.saved)


def vm_data() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))


class Wide(TrainModule):
    """16 layers of 1024 x 1024: 16.8M parameters, 64 MB in fp32."""

    WIDTH, DEPTH = 1024, 16

    def __init__(self) -> None:
        super().__init__()
        self.layers = None
        self.losses: list[float] = []

    def configure_model(self):
        if self.layers is None:
            self.layers = nn.ModuleList(nn.Linear(self.WIDTH, self.WIDTH) for _ in range(self.DEPTH))

    def training_step(self, batch, batch_idx):
        x, = batch
        for layer in self.layers:
            x = torch.tanh(layer(x))
        loss = (x - 0.5).pow(2).mean()
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self):
        x = torch.randn(64, self.WIDTH, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x), batch_size=4)


def _memory_cap() -> dict:
    full = Wide.DEPTH * (Wide.WIDTH + 1) * Wide.WIDTH * 4
    # a rank's peak above the cap's starting point, measured on 4 ranks (VmData): ~47.5 MB, 0.74
    # of the model - its shards and gradient partitions, one gathered layer with its gradient,
    # and up to three bf16 reduction buffers in flight (a layer plus gloo's all-to-all scratch
    # each). The cap leaves 8 MB above that, and stays below the model's 64 MB
    cap = MemoryCap(int(0.875 * full), full)
    module = Wide()
    try:
        # host_mmap_threshold 128 KiB: freed blocks of 4 MB (a layer opened while it is built)
        # leave the heap at once, which RLIMIT_DATA counts, so the cap measures what the strategy
        # holds, not glibc's cache (the default 8 MiB keeps them in a heap that fragments)
        fit(module, ZeroStage3(reduce_dtype="bf16", prefetch_bucket_size=0, max_reuse_distance=0,
                               host_mmap_threshold=1 << 17), accum=1, steps=2, callbacks=[cap])
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    finally:
        cap.release()
    return {"refused": cap.refused, "losses": torch.tensor(module.losses), "full": full,
            "budget": cap.budget, "peak_rss": peak}


@pytest.mark.slow
def test_trains_a_model_larger_than_the_memory_budget(tmp_path):
    for res in run_ranks("test_zero3_memory_cap:_memory_cap", 4, tmp_path, timeout=240):
        assert res["budget"] < res["full"]
        assert res["refused"], "the cap did not refuse an allocation of the full model"
        losses = res["losses"]
        assert torch.isfinite(losses).all() and losses[-1] < losses[0], losses
