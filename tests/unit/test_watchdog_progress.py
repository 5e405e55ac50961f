"""How far a rank got, as the progress watchdog counts it: every callback of a hook is a phase of
its own, and the collectives issued within a phase count for less than any phase (ranks that
disagree on their collectives issue different numbers of them)."""
from __future__ import annotations

from zerotrain import Callback
from zerotrain.trainer.loop.hooks import HookDispatcher
from zerotrain.trainer.launch.watchdog import Progress, ProgressWatchdog, find_stuck


def _dog() -> ProgressWatchdog:
    return ProgressWatchdog(rank=0, world_size=2, store=None, timeout_s=3.0, key="t")


def test_a_later_phase_outranks_any_number_of_collectives_in_an_earlier_one():
    behind, ahead = _dog(), _dog()
    for dog in (behind, ahead):
        dog.tick("on_train_batch_end (Sampler)", 4)
    for _ in range(50):  # a forward on one rank alone: its gathers
        behind.mark("all_gather")
    ahead.tick("on_train_batch_end (ModelCheckpoint)", 4)
    ahead.mark("all_reduce")  # the checkpoint's first collective, waiting for the other rank
    assert ahead._ticks > behind._ticks
    progress = {0: Progress(behind._ticks, 4, "x", 10.0), 1: Progress(ahead._ticks, 4, "y", 10.0)}
    assert find_stuck(progress, timeout_s=3.0) == 0


def test_collectives_order_ranks_within_one_phase():
    stuck, waiting = _dog(), _dog()
    for dog in (stuck, waiting):
        dog.tick("backward", 2)
    waiting.mark("all_reduce")  # issued the bucket's all-reduce; the other never got there
    progress = {0: Progress(stuck._ticks, 2, "x", 10.0), 1: Progress(waiting._ticks, 2, "y", 10.0)}
    assert find_stuck(progress, timeout_s=3.0) == 0


def test_each_callback_of_a_hook_is_a_phase():
    class Trainerish:
        def __init__(self):
            self.phases = []

        def _tick(self, phase):
            self.phases.append(phase)

    class A(Callback):
        def on_train_batch_end(self, trainer, module, *args):
            pass

    class B(A):
        pass

    trainer = Trainerish()
    hooks = HookDispatcher([A(), Callback(), B()], mark=trainer._tick)
    hooks("on_train_batch_end", trainer, None, None, None, 0)
    # Callback's own no-op hooks count too: every rank has the same callbacks, so the same phases
    assert trainer.phases == ["on_train_batch_end (A)", "on_train_batch_end (Callback)", "on_train_batch_end (B)"]
    # a hook that runs only where a checkpoint file is written would make the ranks' counts differ
    hooks("on_save_checkpoint", trainer, None, {})
    assert len(trainer.phases) == 3
