"""One job of the fault campaign (``bench/fault_campaign.py``): a tiny MLP trained for a few steps
under one strategy, with at most one fault injected from inside (the other faults come from the
driver, as signals). Run as ``python -m zerotrain.bench.fault_job CONFIG.json`` (our launcher
re-runs the same command for the other ranks) or under ``torchrun ... -m zerotrain.bench.fault_job``.

CONFIG holds: ``strategy``, ``world``, ``steps`` (max_steps), ``root`` (the job's folder: its
checkpoints in ``root/ck``, one per step, all kept), ``resume`` (None, ``"latest"`` or a checkpoint
folder), ``out`` (rank 0 saves the final full state dict there), ``stall_timeout_s`` and ``fault``
(None or ``{"kind", "rank", "step"}``). Every rank writes ``root/pid.R`` when fit starts and
``root/at.R.K`` when step K begins (the driver sends its signals on those), and prints
``FAULT <kind> rank R step K at <time>`` just before it injects a fault itself. ``pace_s``: every
rank sleeps that long at the start of each step, so that a signal the driver sends a moment after
step K began lands in step K or K+1, not after the end of a job of tiny steps.
"""
from __future__ import annotations

import errno
import json
import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from zerotrain import Callback, ModelCheckpoint, TrainModule, Trainer

#: the exception an injected fault raises (the driver looks for its name)
FAULT_TEXT = "FaultInjected"


class FaultInjected(RuntimeError):
    pass


def announce(kind: str, rank: int, step: int) -> None:
    sys.stderr.write(f"FAULT {kind} rank {rank} step {step} at {time.time():.3f}\n")
    sys.stderr.flush()


def make_data(n: int = 512, d_in: int = 12) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, d_in, generator=g)
    y = torch.tanh(x @ torch.randn(d_in, 3, generator=g)) + 0.1 * torch.randn(n, 3, generator=g)
    return TensorDataset(x, y)


def build_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 37), nn.GELU(), nn.Linear(37, 37), nn.GELU(), nn.Linear(37, 3))


def strategy_for(name: str, world: int, root: str):
    from zerotrain.strategies import Offload
    from zerotrain.strategies.pipeline import PipelineStrategy

    if name == "offload_cpu":
        return Offload(stage=2, optimizer_device="cpu")
    if name == "offload_nvme":
        return Offload(stage=3, optimizer_device="nvme", param_device="nvme", nvme_path=os.path.join(root, "nvme"))
    if name == "pipeline":
        return PipelineStrategy(stages=world, micro_batches=2)
    return name


class Job(TrainModule):
    def __init__(self, cfg: dict):
        super().__init__()
        self.cfg, self.fault = cfg, cfg.get("fault") or {}
        if cfg["strategy"] == "pipeline":
            from zerotrain.strategies.pipeline import PipelineModule

            self.pipe = PipelineModule.from_sequential(build_net(), cfg["world"], loss_fn=self._loss)
        else:
            self.net = build_net()

    def _hit(self, kind: str) -> bool:
        f = self.fault
        return f.get("kind") == kind and self.trainer.global_step == f["step"] and self.global_rank == f["rank"]

    def _loss(self, out, y):
        loss = nn.functional.mse_loss(out, y)
        if self._hit("nan"):
            announce("nan", self.global_rank, self.trainer.global_step)
            loss = loss * float("nan")
        return loss

    def training_step(self, batch, batch_idx):  # not called under the pipeline (its schedule runs the stages)
        if self._hit("exception_step"):
            announce("exception_step", self.global_rank, self.trainer.global_step)
            raise FaultInjected(f"{FAULT_TEXT} in training_step")
        x, y = batch
        return self._loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.02, weight_decay=0.1)

    def train_dataloader(self):
        return DataLoader(make_data(), batch_size=4, shuffle=True)


class Injector(Callback):
    """Markers for the driver, and the faults raised from hooks."""

    def __init__(self, cfg: dict):
        self.root, self.fault, self.pace_s = cfg["root"], cfg.get("fault") or {}, cfg.get("pace_s", 0.0)

    def _hit(self, trainer, kind: str) -> bool:
        f = self.fault
        return f.get("kind") == kind and trainer.global_step == f["step"] and trainer.global_rank == f["rank"]

    def on_fit_start(self, trainer, module):
        with open(os.path.join(self.root, f"pid.{trainer.global_rank}"), "w") as f:
            f.write(str(os.getpid()))
        if self.fault.get("kind") == "enospc" and trainer.global_rank == self.fault["rank"]:
            _fill_disk_at(trainer, self.fault["step"])

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        open(os.path.join(self.root, f"at.{trainer.global_rank}.{trainer.global_step}"), "w").close()
        time.sleep(self.pace_s)  # room for the driver's signal to land within the step it aims at
        if self._hit(trainer, "exception_step") and self.fault.get("pipeline"):
            # the pipeline runs no training_step: the stage's forward raises instead
            def boom(*_):
                raise FaultInjected(f"{FAULT_TEXT} in training_step (the stage's forward)")
            announce("exception_step", trainer.global_rank, trainer.global_step)
            self._hook = next(m for m in module.modules() if not list(m.children())).register_forward_pre_hook(boom)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        step = trainer.global_step - 1  # the step that just ended
        f = self.fault
        if f.get("kind") == "exception_callback" and step == f["step"] and trainer.global_rank == f["rank"]:
            announce("exception_callback", trainer.global_rank, step)
            raise FaultInjected(f"{FAULT_TEXT} in on_train_batch_end")
        if f.get("kind") == "rank0_forward" and step == f["step"] and trainer.is_global_zero:
            announce("rank0_forward", 0, step)
            with torch.no_grad():  # the classic trap: a forward on rank 0 alone
                for _ in range(20):
                    if hasattr(module, "net"):
                        module.net(torch.randn(2, 12))
                    else:
                        module.pipe(torch.randn(2, 12))


def _fill_disk_at(trainer, step: int) -> None:
    """ENOSPC in this rank's shard of the checkpoint of ``step``: half the file is written, then
    the write fails as on a full disk (an injection in the checkpoint writer, this process only)."""
    from zerotrain.trainer.checkpoint import directory as checkpoint_io

    write = checkpoint_io._write_shard

    def full_disk(file, entries, rank):
        if trainer.global_step != step:
            return write(file, entries, rank)
        digest = write(file, entries, rank)
        os.truncate(file, digest.size // 2)
        announce("enospc", rank, step)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file))

    checkpoint_io._write_shard = full_disk
    # one-file checkpoints (replicated state, rank 0): the disk fills after the first 16 KiB
    from zerotrain.trainer.checkpoint import single_file as checkpoint_file

    opened = checkpoint_file._Writer.__init__

    class FullDisk:
        def __init__(self, f):
            self._f, self._left = f, 16 << 10

        def write(self, data):
            if self._left < len(data):
                announce("enospc", trainer.global_rank, step)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._f.name)
            self._left -= len(data)
            return self._f.write(data)

        def __getattr__(self, name):
            return getattr(self._f, name)

    def writer(self, f):
        opened(self, FullDisk(f) if trainer.global_step == step else f)

    checkpoint_file._Writer.__init__ = writer


def main(path: str) -> None:
    cfg = json.loads(open(path).read())
    torch.set_num_threads(1)
    if cfg["strategy"] == "pipeline" and cfg.get("fault"):
        cfg["fault"]["pipeline"] = True
    ck = os.path.join(cfg["root"], "ck")
    trainer = Trainer(strategy=strategy_for(cfg["strategy"], cfg["world"], cfg["root"]), devices=cfg["world"],
                      accelerator="cpu", max_steps=cfg["steps"], logger=False, enable_progress_bar=False,
                      enable_model_summary=False, stall_timeout_s=cfg["stall_timeout_s"],
                      default_root_dir=cfg["root"],
                      callbacks=[ModelCheckpoint(dirpath=ck,
                                                 filename="{step:06d}", every_n_train_steps=1, save_top_k=-1,
                                                 save_last=False),
                                 Injector(cfg)])
    trainer.fit(Job(cfg), ckpt_path=cfg.get("resume"))
    full = trainer.full_state_dict()  # collective
    if trainer.is_global_zero:
        torch.save({k: v.clone() for k, v in full.items()}, cfg["out"])
    print(f"rank {trainer.global_rank} finished at step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
