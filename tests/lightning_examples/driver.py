"""One side of a Lightning example's comparison, run by ``torchrun --nproc_per_node 2``:
``driver.py <example.py> <lib: pl | zerotrain> <strategy> <out dir>``. Imports the example file
(for zerotrain, the renamed copy ``run_examples.py`` wrote), runs its ``main`` with a CSVLogger
and a recording callback of that library, and writes what it saw to ``<out>/rank<r>.json``:
per training batch the metric dicts, after each stage the dicts and ``validate``/``test``
results, the CSV rows (rank 0) and the final parameters (rank 0, whole)."""
from __future__ import annotations

import csv
import importlib.util
import json
import os
import sys

import torch


def _numbers(metrics) -> dict:
    return {k: float(v) for k, v in metrics.items()}


def _load(path: str):
    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _recorder(base):
    class Record(base):
        """What a Lightning user's callback sees after every training batch."""

        def __init__(self):
            self.batches = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.batches.append({"global_step": trainer.global_step, "callback": _numbers(trainer.callback_metrics),
                                 "pbar": dict(trainer.progress_bar_metrics)})

    return Record()


def _nudger(base, seed: int):
    """The peer run's callback: after every optimizer step (a new ``global_step``) each parameter
    moves one fp32 ulp up or down, signs drawn from ``seed`` (the same on every rank): a step as
    valid as the optimizer's own, which rounds each element (tests/tolerance.py)."""
    from tolerance import nudge_one_ulp

    class Nudge(base):
        def __init__(self):
            self.gen, self.step = torch.Generator().manual_seed(seed), 0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step != self.step:
                self.step = trainer.global_step
                nudge_one_ulp(list(pl_module.parameters()), self.gen)

    return Nudge()


def _final_params(lib: str, trainer, model) -> dict:
    """The whole model on global rank 0 (zerotrain gathers a sharded one collectively)."""
    state = trainer.full_state_dict() if lib == "zerotrain" else model.state_dict()
    return {k: v.detach().cpu().double().flatten().tolist() for k, v in state.items()}


def main(example: str, lib: str, strategy: str, out: str) -> None:
    if lib == "pl":
        from pytorch_lightning import Callback
        from pytorch_lightning.loggers import CSVLogger
    else:
        from zerotrain import Callback
        from zerotrain.loggers import CSVLogger
    record, logger = _recorder(Callback), CSVLogger(os.path.join(out, "logs"), version=0)
    seed = os.environ.get("ZEROTRAIN_TEST_NUDGE_SEED")
    callbacks = [record] if seed is None else [record, _nudger(Callback, int(seed))]
    trainer, model, results = _load(example).main(
        accelerator="cpu", devices=2, strategy=strategy, callbacks=callbacks, logger=logger,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    rank = trainer.global_rank
    params = _final_params(lib, trainer, model)
    result = {"batches": record.batches, "results": results, "params": params if rank == 0 else {},
              "callback": _numbers(trainer.callback_metrics), "logged": _numbers(trainer.logged_metrics),
              "global_step": trainer.global_step}
    if rank == 0:
        logger.save()
        with open(os.path.join(logger.log_dir, "metrics.csv"), newline="") as f:
            result["rows"] = list(csv.DictReader(f))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if lib == "pl":
        # Lightning leaves its gloo group (held by its DDP wrapper) to interpreter finalization,
        # where torch's worker threads abort the process now and then after a successful run
        # (SIGABRT, "terminate called without an active exception"): the reference side's record is
        # written, so it leaves without finalization. zerotrain's side exits normally (its own
        # exit path is what tests/distributed/test_shutdown.py checks).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(*sys.argv[1:5])
