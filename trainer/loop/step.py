"""One training step's two halves, as the Trainer's loop calls them: a micro-batch's forwards and
backwards under automatic optimization (``forward_backward``, through ``Strategy.run_schedule``
with ``BatchHooks`` called back), and the accumulation's optimizer step with its counters
(``optimizer_step``); between them, what the running step has seen (``state.StepState``) and the
``on_nonfinite`` policy for its loss (``check_finite``)."""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ConfigError
from ..launch import elastic
from ..logs.connector import hook_scope
from .state import StepState

if TYPE_CHECKING:
    from .trainer import Trainer

log = logging.getLogger("zerotrain")


class NonFiniteLossError(FloatingPointError):
    """The training loss is inf or nan (``Trainer(on_nonfinite="raise")``, the default)."""


def forward_backward(trainer: "Trainer", batch: Any, batch_idx: int, last_micro: bool) -> Any:
    """The batch's forwards and backwards through ``Strategy.run_schedule``, which calls back the
    hooks it can honour (``BatchHooks``): every strategy the loss check, the ordinary step
    also ``on_before_backward``/``on_after_backward``; a strategy running its own schedule (the
    pipeline) skips those two (its ``skipped_hooks``); its loss is logged as ``train_loss``. Inside
    an accumulation the gradients are not reduced (``no_sync``). Returns the step's output."""
    s = trainer.strategy
    trainer.state.step.batch = batch  # an optimizer that re-evaluates (LBFGS) runs it again
    batch_hooks = BatchHooks(trainer, batch_idx)
    with (s.no_sync() if not last_micro else contextlib.nullcontext()), hook_scope(trainer, "training_step"):
        trainer.hooks.mark("training_step")
        out = s.run_schedule(batch, batch_idx, batch_hooks)
        if not batch_hooks.called:
            raise RuntimeError(f"strategy={s!r}: run_schedule returned without calling hooks.loss_of; "
                               "valid: every run_schedule checks its loss through hooks.loss_of once")
        if batch_hooks.loss is not None and not batch_hooks.step_logged:  # the pipeline's loss
            trainer.metrics_connector.log_loss("train_loss", batch_hooks.loss)
    return out


def optimizer_step(trainer: "Trainer", batch_idx: int) -> None:
    """The accumulation's optimizer step. ``on_nonfinite="skip"``: a bad loss on any rank skips it
    on every rank together. The step is counted either way (a skipped one also as skipped); the
    step-interval schedulers step after it unless it was skipped, as Lightning. The first step
    lowers the collective timeout (``elastic``) and warms the progress watchdog."""
    st, s, optim = trainer.state, trainer.strategy, trainer.optimization
    trainer.hooks.mark("optimizer_step")
    if trainer.on_nonfinite == "skip" and s.any_rank(st.step.nonfinite):
        stepped: bool | None = False
        s.skip_step()
    else:  # None: the module's optimizer_step did not step, or every training_step returned None
        stepped = optim.optimizer_step(batch_idx)
    st.step = StepState()  # the next accumulation starts
    elastic.lower_after_first_step(s, trainer.collective_timeout_s)
    if trainer._watchdog is not None:
        trainer._watchdog.warmed()
    st.skipped_steps += stepped is False
    st.global_step += 1
    if stepped is not False:  # after the step is counted, as Lightning
        optim.step_schedulers("step", plateau=False, index=batch_idx)


def check_finite(trainer: "Trainer", loss: torch.Tensor, batch_idx: int) -> None:
    """``on_nonfinite`` for fp32/bf16 (a 16-mixed loss scaler skips overflowing steps itself). With
    ``detect_anomaly`` a nan is left to torch's anomaly mode, which names the op in the backward.
    "skip" marks the running step (``StepState.nonfinite``) for ``optimizer_step``."""
    anomaly_mode = trainer.detect_anomaly and bool(loss.detach().isnan().any())
    if trainer.precision_plugin.skips_nonfinite_steps or anomaly_mode or bool(torch.isfinite(loss.detach()).all()):
        return
    st = trainer.state
    where = (f"rank {trainer.global_rank}: the training loss is {float(loss.detach().float().mean())} at step "
             f"{st.global_step} (epoch {st.epoch}, batch {batch_idx})")
    if trainer.on_nonfinite == "raise":
        raise NonFiniteLossError(f"{where}. Lower the learning rate, clip gradients, check the data, or "
                                 "set Trainer(on_nonfinite='skip' | 'warn')")
    log.warning("%s; %s", where, "the step is skipped on every rank" if trainer.on_nonfinite == "skip"
                else "training goes on (on_nonfinite='warn')")
    st.step.nonfinite = st.step.nonfinite or trainer.on_nonfinite == "skip"


class BatchHooks:
    """The Trainer's side of one ``Strategy.run_schedule`` call (``strategies.base.BatchHooks``):
    checks the loss, keeps it (the pipeline's ``train_loss``), and fires the backward
    hooks when the strategy calls them."""

    def __init__(self, trainer: "Trainer", batch_idx: int) -> None:
        self.trainer, self.batch_idx = trainer, batch_idx
        self.accumulation = trainer.accumulate_grad_batches
        self.loss: torch.Tensor | None = None
        self.step_logged = False
        self.called = False  # loss_of ran (every run_schedule calls it once)
        self._logs_before = trainer.metrics_connector.log_calls  # step_logged: self.log called since

    def loss_of(self, out: Any) -> torch.Tensor | None:
        self.called = True
        if out is None or self.trainer.fit_loop.skip_backward:  # Lightning: no backward for this batch
            self.step_logged = self._logged()
            return None
        if isinstance(out, Mapping) and "loss" not in out:
            raise ConfigError("In automatic_optimization, when `training_step` returns a dict, the 'loss' key "
                              f"needs to be present; got the keys {sorted(map(str, out))}")
        loss = out["loss"] if isinstance(out, Mapping) else out
        if not torch.is_tensor(loss):
            raise ConfigError(f"training_step must return a loss tensor, a dict with 'loss', or None (skip the "
                              f"batch); got {type(out).__name__}")
        check_finite(self.trainer, loss, self.batch_idx)
        if self.batch_idx % self.accumulation == 0:  # the first batch of an accumulation
            self._before_zero_grad()
        self.loss = loss
        # the closure's loss, detached as Lightning's: the Trainer holds no autograd graph between steps
        step = self.trainer.state.step
        step.backward_ran, step.loss = True, loss.detach()
        self.step_logged = self._logged()  # by the step itself, not by the hooks after it
        return loss

    def _logged(self) -> bool:
        return self.trainer.metrics_connector.log_calls != self._logs_before

    def _before_zero_grad(self) -> None:
        """Lightning's ``on_before_zero_grad``, at Lightning's place: after the first training step
        of an accumulation, before its backward. The strategies release the previous step's gradients
        right after that step, so here they are already gone: the hook marks a new accumulation."""
        t = self.trainer
        t.hooks.both("on_before_zero_grad", t, t.module, t.optimizer)
        t.optimization.zero_grad_hook(self.batch_idx)

    def before_backward(self, loss: torch.Tensor) -> None:
        t = self.trainer
        t.hooks.both("on_before_backward", t, t.module, loss)
        t.hooks.mark("backward")

    def after_backward(self) -> None:
        t = self.trainer
        t.hooks.both("on_after_backward", t, t.module)
