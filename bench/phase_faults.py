"""Page faults and time per phase of a training step, on rank 0 (a diagnostic for gpt_bench).

    torchrun --nproc_per_node 2 -m zerotrain.bench.phase_faults --strategy zero3 --model gpt_118m
    torchrun --nproc_per_node 2 -m zerotrain.bench.phase_faults --strategy zero3 \\
        --options '{"max_reuse_distance": 0}'

The Trainer runs the bench's GPT under ``--strategy`` (with ``--options``, a JSON object of the
strategy's options), and a callback reads the minor page faults (pages touched for the first
time) of rank 0's main thread and of its whole process, its wall time and its main thread's CPU
time, at each phase boundary: forward, backward, optimizer step. The warm-up steps are left out;
the figures are means per step. Where a step's faults come from is what gpt_bench's
"faults/step" column cannot say. Under a ZeRO stage a last line gives the host cache's hits,
misses and evictions per step, and the MiB it mapped afresh (``ops/host_cache.py``): a miss takes
pages kept from other sizes, so only those fresh MiB are faulted in.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import time

import torch

from zerotrain.bench.common import MODELS, build_gpt, make_adamw, make_batches
from zerotrain.ops import host_cache

COLUMNS = ("faults main (k)", "faults process (k)", "wall ms", "main CPU ms")


def sample() -> tuple[float, ...]:
    thread, process = resource.getrusage(resource.RUSAGE_THREAD), resource.getrusage(resource.RUSAGE_SELF)
    return thread.ru_minflt / 1e3, process.ru_minflt / 1e3, time.perf_counter() * 1e3, time.thread_time() * 1e3


def main() -> None:
    from zerotrain import Callback, Trainer, TrainModule
    from zerotrain.strategies import strategy_from_name

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--strategy", default="zero3")
    p.add_argument("--options", default="{}", help="the strategy's options as a JSON object")
    p.add_argument("--model", choices=sorted(MODELS), default="gpt_21m_untied")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    spec, world, rank = MODELS[args.model], int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    options = json.loads(args.options)
    strategy = strategy_from_name(args.strategy, **options) if options else args.strategy
    batches = make_batches(spec, "stdlib", 1234, args.warmup + args.steps, rank, world)
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0] * len(COLUMNS))
    last: dict[str, object] = {"phase": None, "at": None, "step": 0}

    def mark(phase: str) -> None:
        now = sample()
        if last["phase"] is not None and last["step"] >= args.warmup:
            row = totals[f"{last['phase']} -> {phase}"]
            for i, (a, b) in enumerate(zip(now, last["at"])):
                row[i] += a - b
        last.update(phase=phase, at=now)

    class Module(TrainModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = None

        def configure_model(self) -> None:
            if self.model is None:
                self.model = build_gpt(spec.config(), 1234, spec.tied)

        def training_step(self, batch, batch_idx):
            mark("forward")
            loss = self.model(*batch)[1]
            mark("forward end")
            return loss

        def configure_optimizers(self):
            return make_adamw(self)[0]

    class Phases(Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            last["step"] = batch_idx
            if batch_idx == args.warmup:
                last["cache"] = host_cache.stats()
            mark("batch start")

        def on_before_backward(self, trainer, module, loss) -> None:
            mark("backward")

        def on_after_backward(self, trainer, module) -> None:
            mark("backward end")

        def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
            mark("optimizer step")

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            mark("batch end")

    trainer = Trainer(accelerator="cpu", devices=world, strategy=strategy, precision="32",
                      max_steps=len(batches), logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, callbacks=[Phases()], seed=1234,
                      default_root_dir=os.environ.get("TMPDIR", "/tmp"))
    trainer.fit(Module(), train_dataloaders=batches)
    if rank == 0:
        print(f"{args.model}, {args.strategy} {options or ''}, {world} ranks: rank 0, mean of {args.steps} steps")
        print(f"| phase | {' | '.join(COLUMNS)} |\n|---|{'---|' * len(COLUMNS)}")
        for phase, row in list(totals.items()) + [("step", [sum(c) for c in zip(*totals.values())])]:
            print(f"| {phase} | {' | '.join(f'{v / args.steps:.1f}' for v in row)} |")
        before, after = last.get("cache"), host_cache.stats()
        if before and after and after["installed"]:
            per_step = {k: (after[k] - before[k]) / args.steps for k in ("hits", "misses", "evicted", "fresh_bytes")}
            print("host cache per step: {hits:.1f} hits, {misses:.1f} misses, {evicted:.1f} evicted, "
                  "{fresh:.1f} MiB mapped afresh; ".format(fresh=per_step.pop("fresh_bytes") / 2**20, **per_step)
                  + f"at the end {after['live_bytes'] / 2**20:.1f} MiB in use, {after['cached_bytes'] / 2**20:.1f} "
                  f"MiB kept, high-water mark {after['peak_bytes'] / 2**20:.1f} MiB, {after['cached_blocks']} blocks kept; "
                  f"{mappings()} mappings in the process")
        elif args.strategy.startswith("zero") and (after is None or not after["installed"]):
            print("host cache: not installed")


def mappings() -> int:
    """The process's memory mappings (the kernel caps them at vm.max_map_count, 65530 by default)."""
    with open(f"/proc/{os.getpid()}/maps") as f:
        return sum(1 for _ in f)


if __name__ == "__main__":
    main()
