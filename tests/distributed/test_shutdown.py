"""A finished job leaves no gloo worker threads for the interpreter's finalization.

CI once saw rank 0 abort after a successful zero1 run ("terminate called without an active
exception", SIGABRT): the first optimizer imports torch._dynamo, which (when the group already
exists) pins the default group, so destroy_process_group() left gloo's worker threads running into
finalization. The library now imports dynamo before making the group and destroys it at exit. DDP's reducer holds
the group too, so a Trainer alive at exit kept the threads running (a DDP rank aborted the same way):
the DDP strategy lets go of its wrapper at exit, before the group is destroyed. CI then saw the
same abort where the script had destroyed the group itself after fit (the harness did): that
destruction joined nothing while DDP still held the group, so the wrapper is released at exit
whether or not the group is still there.

Every spawn here starts fresh interpreters (``fresh=True``): what is checked is what a process that
imported nothing yet does at its real exit, not a rank forked from the harness's zygote.
"""
import atexit
import os
import sys

import pytest
from harness import run_ranks


def _gloo_workers() -> int:
    return sum(open(f"/proc/self/task/{t}/comm").read().strip() == "pt_gloo_runloop"
               for t in os.listdir("/proc/self/task"))


_KEPT = []


def _pipeline_module():
    import copy

    from torch import nn

    from zerotrain import TrainModule
    from zerotrain.strategies.pipeline import PipelineModule

    ref = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))

    class Piped(TrainModule):
        def __init__(self):
            super().__init__()
            self.pipe = PipelineModule.from_sequential(copy.deepcopy(ref), 2, loss_fn=nn.functional.mse_loss)

        def configure_optimizers(self):
            import torch

            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Piped()


def _fit_then_exit_handlers(strategy, user_destroys=False):
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from toy import ToyModule, make_data
    from zerotrain import Trainer
    from zerotrain.strategies.pipeline import PipelineStrategy
    from zerotrain.strategies.zero import ZeroStage3

    assert "torch._dynamo" not in sys.modules  # the library, not the harness, must handle it
    world = int(os.environ["WORLD_SIZE"])
    made = {"pipeline": lambda: PipelineStrategy(stages=2, micro_batches=2),  # 2 stages x 2 replicas: subgroups
            "zero3_hpz": lambda: ZeroStage3(hierarchical_partition=True)}  # one node subgroup per rank
    trainer = Trainer(strategy=made.get(strategy, lambda: strategy)(), devices=world, max_steps=3, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False)
    if strategy == "pipeline":
        trainer.fit(_pipeline_module(), DataLoader(make_data(64), batch_size=4))
    else:
        trainer.fit(ToyModule(n=8 * 2 * 4))
    during = _gloo_workers()
    _KEPT.append(trainer)  # a user's script keeps its Trainer in a global until exit
    if user_destroys:  # as many scripts end (and the harness did): the group goes, DDP's reducer keeps it
        dist.destroy_process_group()
    atexit._run_exitfuncs()  # what interpreter exit runs before finalization
    return {"during": during, "after": _gloo_workers(), "initialized": dist.is_initialized()}


@pytest.mark.parametrize("strategy", [pytest.param("zero1", marks=pytest.mark.slow), pytest.param("ddp", marks=pytest.mark.slow), "zero3"])
def test_exit_handlers_join_gloo_workers_after_fit(tmp_path, strategy):
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("needs /proc to count threads")
    for r in run_ranks("test_shutdown:_fit_then_exit_handlers", 2, tmp_path, timeout=120, fresh=True,
                       strategy=strategy):
        assert r["during"] > 0  # the threads the check is about existed
        assert not r["initialized"]
        assert r["after"] == 0


@pytest.mark.parametrize("strategy,world,env", [pytest.param("pipeline", 4, {}, marks=pytest.mark.slow), ("zero3_hpz", 2, {"LOCAL_WORLD_SIZE": "1"})])
def test_exit_handlers_join_the_gloo_workers_of_subgroups(tmp_path, strategy, world, env):
    """Subgroups a strategy holds (the pipeline's replica groups, hpZ's node groups) keep their
    gloo threads alive past destroy_process_group() unless the strategy lets go of them: before
    the fix a 2x2 pipeline left 2 threads per rank."""
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("needs /proc to count threads")
    for r in run_ranks("test_shutdown:_fit_then_exit_handlers", world, tmp_path, timeout=120, fresh=True, env=env,
                       strategy=strategy):
        assert r["during"] > 0
        assert not r["initialized"]
        assert r["after"] == 0


def test_exit_handlers_join_gloo_workers_when_the_script_destroyed_the_group(tmp_path):
    """The script destroys the group itself after fit (DDP's reducer still holds it, so that joins
    nothing): the exit handlers still release the wrapper, and the group's last reference, in time."""
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("needs /proc to count threads")
    for r in run_ranks("test_shutdown:_fit_then_exit_handlers", 2, tmp_path, timeout=120, fresh=True,
                       strategy="ddp",
                       user_destroys=True):
        assert r["during"] > 0
        assert r["after"] == 0
