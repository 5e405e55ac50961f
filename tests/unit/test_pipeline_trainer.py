"""The real Trainer around a strategy that runs its own schedule (the pipeline, one stage, one
process) against the same Trainer around the ordinary step: which hooks fire, how often the loss
is logged as ``train_loss``, and that the schedule divides by ``accumulate_grad_batches`` as the
ordinary backward does. Both go through ``Strategy.run_schedule``; the Trainer never asks which
strategy it holds."""
from __future__ import annotations

import copy
import logging
from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tolerance import assert_no_worse_than_peer
from zerotrain import Trainer, TrainModule
from zerotrain.callbacks.base import Callback, Logger
from zerotrain.strategies.pipeline import PipelineModule, PipelineStrategy

BATCHES, ROWS, ACCUMULATE = 6, 4, 2


class Counting(Callback):
    """Counts the hooks that bracket a training batch; keeps each batch's returned loss."""

    def __init__(self) -> None:
        self.calls: Counter = Counter()
        self.outputs: list[float] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.calls["on_train_batch_start"] += 1

    def on_before_backward(self, trainer, module, loss):
        self.calls["on_before_backward"] += 1

    def on_after_backward(self, trainer, module):
        self.calls["on_after_backward"] += 1

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.calls["on_before_optimizer_step"] += 1

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.calls["on_train_batch_end"] += 1
        # Lightning's outputs: {"loss": the loss / accumulate_grad_batches, detached}
        self.outputs.append(float(outputs["loss"]) * trainer.accumulate_grad_batches)


class Recorder(Logger):
    def __init__(self) -> None:
        self.steps: list[tuple[int, dict]] = []

    def log_metrics(self, metrics, step):
        self.steps.append((step, dict(metrics)))


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


class Plain(TrainModule):
    def __init__(self, log_own: bool) -> None:
        super().__init__()
        self.net, self.log_own = _net(), log_own

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.log_own:
            self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Split(Plain):
    """The plain step summing the mean losses of two micro-batches as the pipeline's schedule does:
    the peer, an equally valid fp32 order of the same gradients."""

    def training_step(self, batch, batch_idx):
        return sum(nn.functional.mse_loss(self.net(x), y) / 2 for x, y in zip(*(t.chunk(2) for t in batch)))


class Piped(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.pipe = PipelineModule.from_sequential(copy.deepcopy(_net()), 1, loss_fn=nn.functional.mse_loss)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _fit(module: TrainModule, strategy) -> tuple[Trainer, Counting, Recorder, Counter]:
    """Fit on the same data; also count every ``self.log`` call (``trainer.metrics_connector.log``) by name."""
    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(BATCHES * ROWS, 4, generator=g), torch.randn(BATCHES * ROWS, 1, generator=g))
    counting, recorder, logged = Counting(), Recorder(), Counter()
    trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, max_epochs=1, log_every_n_steps=1,
                      accumulate_grad_batches=ACCUMULATE, callbacks=[counting], logger=recorder,
                      enable_checkpointing=False, enable_progress_bar=False)
    log = trainer.metrics_connector.log

    def counted(name, value, **kw):
        logged[name] += 1
        log(name, value, **kw)

    trainer.metrics_connector.log = counted
    trainer.fit(module, DataLoader(data, batch_size=ROWS))
    return trainer, counting, recorder, logged


@pytest.mark.timeout(60)
def test_a_schedule_running_strategy_fires_no_backward_hooks_and_its_loss_is_logged_once(caplog):
    with caplog.at_level(logging.WARNING, logger="zerotrain"):
        trainer, counting, recorder, logged = _fit(Piped(), PipelineStrategy(stages=1, micro_batches=2))
    steps = BATCHES // ACCUMULATE
    # no backward hooks around a schedule that ran every backward already; the rest as usual
    assert counting.calls == Counter(on_train_batch_start=BATCHES, on_train_batch_end=BATCHES,
                                     on_before_optimizer_step=steps)
    warned = [r.getMessage() for r in caplog.records if "never calls" in r.getMessage()]
    assert len(warned) == 1 and "Counting.on_before_backward" in warned[0] and "Counting.on_after_backward" in warned[0]
    # train_loss: once per batch (by the Trainer, not also by the strategy), the loss returned
    assert logged["train_loss"] == BATCHES
    assert trainer.callback_metrics["train_loss"] == pytest.approx(counting.outputs[-1])
    # one row per optimizer step, at Lightning's step (the global_step the batch was trained at)
    assert [s for s, m in recorder.steps if "train_loss" in m] == list(range(steps))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("log_own", [False, True])
def test_the_ordinary_step_fires_the_backward_hooks_and_logs_train_loss_once(caplog, log_own):
    with caplog.at_level(logging.WARNING, logger="zerotrain"):
        trainer, counting, recorder, logged = _fit(Plain(log_own), "single")
    assert counting.calls["on_before_backward"] == counting.calls["on_after_backward"] == BATCHES
    assert not [r for r in caplog.records if "never calls" in r.getMessage()]
    if not log_own:  # as Lightning: a returned loss is not logged (only the pipeline's is)
        assert "train_loss" not in logged and "train_loss" not in trainer.callback_metrics
        return
    assert logged["train_loss"] == BATCHES  # the step's own, once per batch
    assert trainer.callback_metrics["train_loss"] == pytest.approx(counting.outputs[-1])


@pytest.mark.timeout(60)
def test_the_schedule_divides_by_accumulate_grad_batches_like_the_ordinary_backward():
    plain, split, piped = Plain(log_own=False), Split(log_own=False), Piped()
    _fit(plain, "single")
    _fit(split, "single")
    _fit(piped, PipelineStrategy(stages=1, micro_batches=2))
    mine = {k[len("pipe."):]: v for k, v in piped.state_dict().items()}
    # tolerance: no worse than the plain step summing the micro-batches' losses (PEER_FACTOR x + 4 ulps); a
    # schedule that forgot accumulate_grad_batches would be off by the whole step
    assert_no_worse_than_peer(mine, plain.net.state_dict(), split.net.state_dict())


class PipedWithBackwardHook(Piped):
    def on_before_backward(self, loss):
        raise AssertionError("a schedule-running strategy never calls on_before_backward")


@pytest.mark.timeout(60)
def test_a_module_hook_the_schedule_skips_is_warned_about(caplog):
    with caplog.at_level(logging.WARNING, logger="zerotrain"):
        _fit(PipedWithBackwardHook(), PipelineStrategy(stages=1, micro_batches=2))
    warned = [r.getMessage() for r in caplog.records if "never calls" in r.getMessage()]
    assert len(warned) == 1 and "PipedWithBackwardHook.on_before_backward" in warned[0]
