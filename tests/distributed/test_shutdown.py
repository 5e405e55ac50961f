"""A finished job leaves no gloo worker threads for the interpreter's finalization.

CI once saw rank 0 abort after a successful zero1 run ("terminate called without an active
exception", SIGABRT): the first optimizer imports torch._dynamo, which (when the group already
exists) pins the default group, so destroy_process_group() left gloo's worker threads running into
finalization. The library now imports dynamo before making the group and destroys it at exit.
"""
import atexit
import os
import sys

from harness import run_ranks


def _gloo_workers() -> int:
    return sum(open(f"/proc/self/task/{t}/comm").read().strip() == "pt_gloo_runloop"
               for t in os.listdir("/proc/self/task"))


def _fit_then_exit_handlers(strategy):
    import torch.distributed as dist

    from toy import ToyModule
    from zerotrain import Trainer

    assert "torch._dynamo" not in sys.modules  # the library, not the harness, must handle it
    trainer = Trainer(strategy=strategy, devices=2, max_steps=3, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False)
    trainer.fit(ToyModule(n=8 * 2 * 4))
    during = _gloo_workers()
    del trainer
    atexit._run_exitfuncs()  # what interpreter exit runs before finalization
    return {"during": during, "after": _gloo_workers(), "initialized": dist.is_initialized()}


def test_exit_handlers_join_gloo_workers_after_fit(tmp_path):
    if not os.path.isdir("/proc/self/task"):
        import pytest
        pytest.skip("needs /proc to count threads")
    for r in run_ranks("test_shutdown:_fit_then_exit_handlers", 2, tmp_path, timeout=120, strategy="zero1"):
        assert r["during"] > 0  # the threads the check is about existed
        assert not r["initialized"]
        assert r["after"] == 0
