"""The Strategy interface: everything the Trainer needs from a way of distributing training.

The Trainer calls these methods in a fixed order and never asks which strategy it holds:

    connect(info, device, precision) -> setup_environment() -> configure_model(module)
    -> setup_module(module) -> setup_optimizer(optimizer) -> [fit(ckpt_path=...): load_param_shards]
    loop: run_schedule(batch, batch_idx, hooks) [under no_sync() while accumulating]
          -> optimizer_step [save_checkpoint: param_shards, extra_state]
    -> teardown()

``run_schedule`` is every forward and backward of one training batch: the one capability that
differs in kind between strategies, so it is part of the interface rather than something the
Trainer works around. Here it is one forward and one backward, with the Trainer's
``on_before_backward``/``on_after_backward`` around the backward (the Trainer lends them as
``BatchHooks``). A strategy that interleaves many forwards and backwards itself (the pipeline's
1F1B/GPipe schedule) overrides it whole, and this is the only place a strategy may: it has no
single loss before its backwards nor a single moment after them, so it calls only
``hooks.loss_of`` and lists the hooks it never calls in ``skipped_hooks``; the Trainer warns
once when a callback overrides one of those, rather than calling them around a backward that did
nothing. Such a strategy has no separate ``training_step``/``backward`` (calling them raises).
The Trainer never calls ``training_step``/``backward`` itself, only ``run_schedule``; under a
strategy that runs its own schedule (the module's step never runs) it logs the loss that
``hooks.loss_of`` saw as ``train_loss`` (and ``val_loss`` in validation); no strategy logs
metrics itself.

Checkpoints (``trainer/checkpoint/protocol.py``) have one path: a save writes every rank's
``param_shards()`` and ``extra_state()``; a load calls ``load_param_shards(reader)``. Each
strategy family implements them once, in its adapter (``checkpoint.py``: ``checkpoint_adapter``),
and the methods here forward to it. Where this process sits and the collectives are ``environment.Ranks``.

The defaults implement a *replicated* strategy (single process, DDP): every rank holds the whole
model and optimizer, and gradients are identical on every rank when ``optimizer_step`` runs.

The step is written once, here, as a sequence of small pieces; other strategies override pieces,
never the sequence (``run_schedule`` as a whole is the one exception, above; the pipeline's
schedule still runs each forward through ``run_forward`` and each backward through the
precision's ``pre_backward``/``backward``/``post_backward``, and steps through ``optimizer_step``):

    run_schedule                training_step (run_forward) -> hooks.loss_of -> hooks.before_backward
                                -> backward(loss / hooks.accumulation) -> hooks.after_backward
    run_forward                 every forward, under the precision's forward context (autocast)
    backward                    _before_backward -> precision.backward_loss (pre_backward: the loss
                                scale -> backward -> post_backward) -> _after_backward
    user_backward               a backward the user runs: _before_backward -> [the user's autograd,
                                gradients times the plugin's loss_scale] -> _after_backward
    optimizer_step              _gradients_ready -> step_gradients -> precision.unscale_and_check
                                -> precision.update -> [no overflow: clip_grad_norm_ (_grad_norm,
                                _scale_grads) -> _inner_step -> _refresh_params] -> _end_step
                                -> zero_grad -> _after_step   (``which=k``: optimizer k's groups only;
                                ``skip_step``: _gradients_ready -> zero_grad)

ZeRO supplies the gradient buffers around backward, its fp32 gradient partitions, the
all-reduced norm, the sharded inner step and the parameter all-gather; offload its host stepper
(the clip coefficient and loss scale passed to it as one gradient multiplier); the pipeline its
gradient reduction and norm over stages, and its own ``run_schedule``.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator, Protocol

import torch
from torch import nn

from . import instrument, partitioned
from .checkpoint import ParamShard, ReplicatedCheckpoint, ShardReader, split_optimizer_state  # noqa: F401 (re-exported)
from .environment import ProcessInfo, Ranks, init_process_group, mesh_sizes
from .optimizers import accepted, group_indices, refuse_shared, selecting
from .precision import Precision
from .step_wrapper import StepCall, StepWrapper


class BatchHooks(Protocol):
    """What the Trainer lends ``run_schedule`` for one training batch: the loss check and the
    backward hooks, so that the strategy calls the ones it can honour at the moment they mean."""

    #: the loss of each backward is divided by this (the Trainer's ``accumulate_grad_batches``)
    accumulation: int

    def loss_of(self, out: Any) -> torch.Tensor | None:
        """The loss in a training step's output (a tensor, or a dict with ``"loss"``), checked:
        raises for any other output and applies the Trainer's ``on_nonfinite``. Called once.
        None when the step returned None: the strategy skips this batch's backward."""

    def before_backward(self, loss: torch.Tensor) -> None:
        """``on_before_backward`` with the loss about to be backwarded (not yet divided)."""

    def after_backward(self) -> None:
        """``on_after_backward``: the batch's gradients are accumulated."""


#: the default timeout of every collective (seconds); the Trainer's watchdog usually ends a stuck
#: job much sooner (``stall_timeout_s``)
PROCESS_GROUP_TIMEOUT_S = 300.0


class Strategy(Ranks):
    name = "base"
    #: Trainer hooks (``trainer/loop/hooks.py`` names) that this strategy's ``run_schedule`` never
    #: calls; the Trainer warns once when a callback overrides one. The base calls them all.
    skipped_hooks: tuple[str, ...] = ()
    #: True where ``run_schedule`` drives every forward and backward itself (the pipeline): a loop
    #: written by the user (the Engine) cannot drive such a strategy
    runs_own_schedule = False
    partitions_parameters = False  #: a rank holds 1/replicas of the working parameters (ZeRO-3)
    #: the evaluation loops may run under ``torch.inference_mode`` (``Trainer(inference_mode=True)``):
    #: False where a forward gathers or swaps parameters into tensors that training reuses
    #: (an inference tensor cannot be saved for backward), as Lightning uses no_grad under FSDP
    inference_mode_evaluation = False
    #: the module may train in float64 (``precision="64-true"``): True where the strategy keeps it
    #: whole and steps its parameters as they are; the sharded ones keep fp32 master weights
    supports_float64 = False
    #: ``validate``/``test``/``predict`` may run before (or without) ``setup_optimizer``: the
    #: Trainer then asks for the optimizers only when ``fit`` needs them, as Lightning. False where
    #: the optimizer's set-up lays the parameters out (ZeRO's flat groups, the pipeline's stages)
    evaluates_without_optimizer = False
    #: one parameter may be in several optimizers (each keeps and checkpoints its own state of it),
    #: as in Lightning; False where the optimizer state of each parameter is partitioned once (ZeRO)
    optimizers_may_share_parameters = True
    #: given to ``StepWrapper``: the Trainer sets Lightning's signature rule (``trainer/loop/signature.py``)
    step_call: StepCall | None = None
    #: Lightning's ``strategy.launcher``: what started this job's other local ranks from this
    #: process (zerotrain's ``LocalLauncher``, set when it joins the job); None when nothing did
    launcher: Any = None
    #: ``torch.compile`` per block (``strategies/compile.py``; ``Trainer(compile=...)``), applied by
    #: ``compile_module`` after ``setup_module``; ``compiled``: the regions it compiled
    compile: Any = None
    compiled: Any = None
    #: what runs autograd from one (scaled) loss, ``(loss, **backward_kwargs)``: the Trainer lends the
    #: module's ``backward`` hook (Lightning's); None: ``loss.backward()``
    backward_call: Any = None
    #: this strategy family's side of the checkpoint format (``checkpoint.py``): ``checkpointer``
    checkpoint_adapter: Callable[[Any], ReplicatedCheckpoint] = ReplicatedCheckpoint

    def __init__(self, process_group_timeout_s: float = PROCESS_GROUP_TIMEOUT_S, *, sequence_parallel: int = 1) -> None:
        if (isinstance(process_group_timeout_s, bool) or not isinstance(process_group_timeout_s, (int, float))
                or not math.isfinite(process_group_timeout_s) or process_group_timeout_s <= 0):
            raise ValueError(f"process_group_timeout_s={process_group_timeout_s!r} must be a finite number > 0 "
                             "(seconds)")
        self.process_group_timeout_s = float(process_group_timeout_s)
        self.parallel_sizes = mesh_sizes(type(self).__name__, sequence=sequence_parallel)  # environment.Ranks
        self.info = ProcessInfo()
        self.device = torch.device("cpu")
        self.precision = Precision()
        self.module: nn.Module | None = None  # the user's TrainModule, unwrapped
        self.model: nn.Module | None = None  # what the step runs through (may wrap self.module)
        #: the user's optimizer, or an ``OptimizerSet`` of several (``strategies/optimizers.py``)
        self.optimizer: torch.optim.Optimizer | None = None
        #: inside ``optimizer_step(which=k)``: optimizer k's param-group indices (None: every group)
        self._step_groups: list[int] | None = None
        self.step_output: Any = None  # what the last inner step returned (``_inner_step``)

    # ------------------------------------------------------------------ environment
    def connect(self, info: "ProcessInfo | nn.Module", device: torch.device | None = None,
                precision: Precision | None = None) -> None:
        """The Trainer's form: ``connect(info, device, precision)``. Lightning's form,
        ``connect(model)``, attaches the model alone (what ``self.module`` holds until
        ``setup_module`` wraps it), as Lightning's ``Strategy.connect``."""
        if isinstance(info, nn.Module) and device is None and precision is None:
            self.module = self.model = info
            return
        if device is None or precision is None:
            raise TypeError(f"Strategy.connect: got ({type(info).__name__}, {device!r}, {precision!r}); valid: "
                            "connect(info, device, precision) or Lightning's connect(model)")
        self.info, self.device, self.precision = info, device, precision

    @property
    def root_device(self) -> torch.device:
        """Lightning's name: the device this rank computes on (``self.device``)."""
        return self.device

    def on_exception(self, exception: BaseException) -> None:
        """Called by the Trainer when a stage ends in an exception, after the callbacks' and the
        datamodule's ``on_exception`` (Lightning's order). Nothing to do here."""

    def check_world_size(self, world_size: int) -> None:
        """Raise ValueError when this strategy cannot run on ``world_size`` processes; called by
        the Trainer (and Engine) before any rank starts. Every size the mesh's axes divide."""
        self.check_mesh(world_size)

    def check_precision(self, precision: "Precision", name: str) -> None:
        """Raise ValueError when this strategy's options cannot run under ``precision`` (named
        ``name``); called by the Trainer (and Engine) before any rank starts. Any by default."""

    def setup_environment(self) -> None:
        init_process_group(self.info, self.device, self.process_group_timeout_s)
        self.build_mesh()

    # ------------------------------------------------------------------ model and optimizer
    def configure_model(self, module: nn.Module) -> None:
        """Let the module build its layers (``TrainModule.configure_model``) inside ``init_context``."""
        with self.init_context():
            module.configure_model()

    def init_context(self) -> contextlib.AbstractContextManager:
        """Where the model's parameters are created: the Trainer's ``configure_model`` and the
        Engine's ``init_module()`` (a loop the user writes) build inside it. Here nothing changes;
        ZeRO-3 partitions each parameter as it is registered, so no rank holds the model whole."""
        return contextlib.nullcontext()

    def setup_module(self, module: nn.Module) -> None:
        """Cast the module for the precision (the one place ``convert_module`` is called), move it
        to the device and wrap it for the step methods. Sharded strategies keep the parameters as
        built (fp32 unless "-true") until ``setup_optimizer``, so master weights start exact."""
        partitioned.refuse_other(module, self)
        module = self.precision.convert_module(module).to(self.device)
        self.module = module
        self.model = StepWrapper(module, self.step_call)

    def compile_blocks(self) -> list[nn.Module] | None:
        """The modules to compile one by one (None: ``compile.repeated_blocks`` finds them)."""
        return None

    def compile_module(self) -> None:
        """After ``setup_module``: compile ``self.compile``'s regions (once; nothing without it)."""
        if self.compile is not None and self.compiled is None and self.module is not None:
            from .compile import compile_regions
            self.compiled = compile_regions(self.module, self.compile, self.compile_blocks())

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        refuse_shared(self, optimizer)
        self.optimizer = optimizer

    def parameters_for_optimizer(self) -> Iterator[nn.Parameter]:
        assert self.module is not None
        return self.module.parameters()

    # ------------------------------------------------------------------ the step
    # Forward, backward and optimizer step are written once, here. A strategy supplies pieces
    # (the ``_``-prefixed hooks below and ``step_gradients``/``zero_grad``), never its own copy
    # of the sequence.

    def run_forward(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` under the precision's forward context (autocast for the mixed
        precisions): every forward the library runs enters it here, the training and validation
        steps and each micro-batch of a pipeline schedule."""
        with self.precision.forward_context(self.device.type):
            return fn(*args, **kwargs)

    def run_schedule(self, batch: Any, batch_idx: int, hooks: BatchHooks) -> Any:
        """Every forward and backward of one training batch; returns what the training step
        returned (a loss, or a dict with ``"loss"``). Here: the TrainModule's ``training_step``
        (``run_forward``), then one ``backward`` of its loss divided by ``hooks.accumulation``,
        between ``hooks.before_backward`` and ``hooks.after_backward``. A strategy that runs a
        schedule of its own overrides this whole and lists the hooks it skips in ``skipped_hooks``."""
        out = self.training_step(batch, batch_idx)
        loss = hooks.loss_of(out)
        if loss is None:  # the step returned None: no backward for this batch (Lightning's skip)
            return out
        hooks.before_backward(loss)
        self.backward(loss / hooks.accumulation)
        hooks.after_backward()
        return out

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return self.run_forward(self.model, "training_step", self.local_batch(batch), batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        return self.run_forward(self.model, "validation_step", self.local_batch(batch), batch_idx)

    def backward(self, loss: torch.Tensor, **backward_kwargs: Any) -> None:
        """The precision plugin's backward of the loss (``backward_loss``: loss scale, autograd),
        between the strategy's own ``_before_backward``/``_after_backward`` (ZeRO: gradient buffers
        and bucketed reductions). ``backward_kwargs`` (``retain_graph``, ...) go to ``Tensor.backward``."""
        self._before_backward()
        self.precision.backward_loss(loss, self.model, run=self.backward_call, **backward_kwargs)
        self._after_backward()

    def begin_user_backward(self, loss: torch.Tensor | None = None) -> float:
        """For an autograd pass the user starts themselves (a DeepSpeed script's plain
        ``loss.backward()``): the strategy's part before autograd, now (with ``loss``: as before a
        ``manual_backward`` of it). Returns the precision plugin's loss scale, which the gradients
        entering the model must carry. Then ``end_user_backward`` (or use ``user_backward``)."""
        if loss is not None:
            self._before_manual_backward(loss)
        self._before_backward()
        return self.precision.loss_scale

    def end_user_backward(self) -> None:
        """The strategy's part after autograd (gradient reductions) for ``begin_user_backward``."""
        self._after_backward()

    @contextlib.contextmanager
    def user_backward(self, loss: torch.Tensor | None = None) -> Iterator[float]:
        """``with strategy.user_backward() as scale: (loss * scale).backward()``: the strategy's
        parts around it; not after an exception (its reductions would wait for missing gradients)."""
        scale = self.begin_user_backward(loss)
        yield scale
        self.end_user_backward()

    def _before_backward(self) -> None:
        """Before autograd runs for one micro-batch."""

    def _after_backward(self) -> None:
        """After autograd ran for one micro-batch (inside ``no_sync()`` too)."""

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Context for micro-batches that only accumulate gradients (no communication)."""
        return contextlib.nullcontext()

    def optimizer_step(self, gradient_clip_val: float | None = None,
                       gradient_clip_algorithm: str = "norm", which: int | None = None,
                       zero_grad: bool = True, error_if_nonfinite: bool = False,
                       step_kwargs: dict[str, Any] | None = None) -> bool:
        """Gradients ready -> unscale and check overflow (every rank together) -> clip (by global
        norm, or by value: ``gradient_clip_algorithm``) -> inner step -> refresh the working
        parameters -> zero the gradients. On overflow the step is skipped on every rank (the
        gradients are still zeroed). Returns whether it stepped.

        ``which``: step optimizer ``which`` of an ``OptimizerSet`` only - every piece (unscale,
        overflow, clip, inner step, zeroing) sees that optimizer's param groups only, as a plain
        PyTorch ``opt.step()`` touches only its parameters. ``zero_grad=False`` (manual
        optimization) keeps the gradients: the user zeroes them, and until then they accumulate.
        Clipping by norm leaves the norm before clipping in ``last_grad_norm`` (None otherwise);
        ``error_if_nonfinite``: a non-finite norm raises before any gradient changes, as
        ``torch.nn.utils.clip_grad_norm_(error_if_nonfinite=True)``. ``step_kwargs``: given to the
        user's ``optimizer.step`` where the strategy steps it itself (Lightning's ``opt.step(closure=,
        **kwargs)``; a closure there only returns what already ran)."""
        self.last_grad_norm: torch.Tensor | None = None
        self._step_kwargs = step_kwargs or {}
        with self._selecting(which):
            self._gradients_ready()
            loss_scale = self.precision.loss_scale  # what backward scaled by (update() may change it)
            overflow = self.precision.unscale_and_check(self.step_gradients(), self.any_rank)
            self.precision.update(overflow)
            if not overflow:
                if gradient_clip_val and gradient_clip_algorithm == "value":
                    self.clip_grad_value_(gradient_clip_val, loss_scale)
                elif gradient_clip_val:
                    self.last_grad_norm = self.clip_grad_norm_(gradient_clip_val, error_if_nonfinite)
                self._inner_step(loss_scale)
                instrument.phase("refresh")  # the step-time breakdown's parameter refresh
                self._refresh_params()
            self._end_step()
            if zero_grad:
                self.zero_grad(which)
            self._after_step(stepped=not overflow)
        return not overflow

    @contextlib.contextmanager
    def _selecting(self, which: int | None) -> Iterator[None]:
        """Restrict the step's pieces to optimizer ``which``'s param groups (None: all)."""
        prev, self._step_groups = self._step_groups, group_indices(self.optimizer, which)
        try:
            with selecting(self.optimizer, which):
                yield
        finally:
            self._step_groups = prev

    def _selected_params(self) -> set[int] | None:
        """``id``s of the parameters in the selected param groups (None: no selection)."""
        if self._step_groups is None:
            return None
        groups = self.optimizer.param_groups
        return {id(p) for g in self._step_groups for p in groups[g]["params"]}

    def _end_step(self) -> None:
        """After the inner step, taken or not, before any zeroing: forget what belonged to this
        step only (a stepper's gradient copies, a folded clip coefficient)."""

    def manual_backward(self, loss: torch.Tensor, **backward_kwargs: Any) -> None:
        """A backward the user calls in a training step (Lightning's manual optimization): as
        ``backward``, after ``_before_manual_backward`` (DDP: re-arm its reducer for this loss, as
        several backwards may follow one forward). Always synchronising: the gradients of every
        backward accumulate until the user zeroes them."""
        self._before_manual_backward(loss)
        self.backward(loss, **backward_kwargs) if backward_kwargs else self.backward(loss)

    def _before_manual_backward(self, loss: torch.Tensor) -> None:
        """Before a user-called backward."""

    def skip_step(self) -> None:
        """Collective: drop this step's gradients without stepping (every rank together; the
        Trainer's ``on_nonfinite="skip"``)."""
        self._gradients_ready()
        self.zero_grad()

    def _gradients_ready(self) -> None:
        """Collective where a strategy communicates here: make ``step_gradients()`` final (finish
        or run the reductions the backward did not)."""

    def step_gradients(self) -> list[torch.Tensor]:
        """The gradient tensors this rank's optimizer steps on, after reduction (those of the
        selected optimizer inside ``optimizer_step(which=k)``)."""
        assert self.module is not None
        mine = self._selected_params()
        return [p.grad for p in self.module.parameters() if p.grad is not None and (mine is None or id(p) in mine)]

    def clip_grad_norm_(self, max_norm: float, error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the step gradients to a global L2 norm of ``max_norm``; returns the norm before
        clipping (collective where the gradients are spread over ranks). ``error_if_nonfinite``:
        a NaN or infinite norm raises (every rank holds the same global norm, so all raise)."""
        total = self._grad_norm()
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"clip_gradients: the gradients' total 2-norm is non-finite ({total.item()}); "
                               "nothing was clipped or stepped (error_if_nonfinite=False clips anyway)")
        self._scale_grads(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        return total

    def clip_grad_value_(self, clip_value: float, loss_scale: float = 1.0) -> None:
        """Clamp every element of the step gradients to ``[-clip_value, clip_value]``, as
        ``torch.nn.utils.clip_grad_value_``. Element-wise, so a sharded rank clamping only its
        partition clamps its share of the full gradient: no communication. ``loss_scale``: what
        backward scaled by, for a stepper whose gradient copies still carry it (offload)."""
        self._clamp_grads(float(clip_value), loss_scale)

    def _clamp_grads(self, clip_value: float, loss_scale: float) -> None:
        """Clamp what the inner step will read (here: the step gradients, in place)."""
        for g in self.step_gradients():
            g.detach().clamp_(-clip_value, clip_value)

    def _grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the step gradients. Replicated strategies: this rank's, computed
        as ``torch.nn.utils.clip_grad_norm_`` computes it (the norm of the per-tensor norms), so
        clipping rounds exactly as a plain PyTorch loop (and Lightning) does."""
        grads = [g.detach() if g.dtype == torch.float32 else g.detach().float() for g in self.step_gradients()]
        if not grads:
            return torch.zeros((), device=self.device)
        return torch.nn.utils.get_total_norm(grads, norm_type=2.0)

    def _scale_grads(self, coef: torch.Tensor) -> None:
        """Multiply the step gradients by the clip coefficient ``coef`` (at most 1)."""
        for g in self.step_gradients():
            g.detach().mul_(coef.to(g.dtype))

    def _inner_step(self, loss_scale: float) -> None:
        """Step the optimizer on the unscaled, clipped step gradients. ``loss_scale`` is what
        backward multiplied the loss by, for a stepper that reads gradient copies taken before
        the unscale (offload's GPU path). What the optimizer's ``step()`` returned is kept in
        ``step_output`` (Lightning's ``optimizer.step()`` returns it in manual optimization)."""
        assert self.optimizer is not None
        self.step_output = self.optimizer.step(**accepted(self.optimizer.step, getattr(self, "_step_kwargs", {})))

    def _refresh_params(self) -> None:
        """After the inner step: bring the working parameters up to date (ZeRO: all-gather the
        updated partitions). Replicated strategies step the working parameters themselves."""

    def zero_grad(self, which: int | None = None) -> None:
        """Release the gradients of every parameter, or of optimizer ``which``'s only (the others
        keep accumulating, as in a plain PyTorch loop)."""
        assert self.optimizer is not None
        with selecting(self.optimizer, which):
            self.optimizer.zero_grad(set_to_none=True)

    def _after_step(self, stepped: bool) -> None:
        """After every optimizer step, taken or skipped for overflow."""

    def stall_hint(self) -> str:
        """A hint the progress watchdog prints when a rank of this strategy stalls the others."""
        return ""

    # ------------------------------------------------------------------ checkpoints (the adapter's)
    @property
    def checkpointer(self) -> ReplicatedCheckpoint:
        """This strategy's checkpoint adapter (stateless: a new one per call, so that the strategy
        and its adapter never hold each other and the strategy is freed as soon as it is dropped)."""
        return self.checkpoint_adapter(self)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the complete fp32 model state on global rank 0, ``{}`` elsewhere."""
        return self.checkpointer.full_state_dict()

    def writes_shard(self) -> bool:
        """Whether this rank's ``param_shards``/``extra_state`` hold anything."""
        return self.checkpointer.writes_shard()

    def checkpoint_model_info(self) -> dict[str, Any]:
        """Trainable parameters by canonical name, their aliases, the extras and the state-dict keys."""
        return self.checkpointer.checkpoint_model_info()

    def optimizer_group_names(self) -> list[list[str]]:
        """The canonical names of the trainable parameters in each optimizer param group."""
        return self.checkpointer.optimizer_group_names()

    def param_shards(self) -> dict[str, ParamShard]:
        """This rank's part of every trainable parameter, with its optimizer state."""
        return self.checkpointer.param_shards()

    def extra_state(self) -> dict[str, torch.Tensor]:
        """The state-dict entries that are not trainable parameters, from the ranks that save."""
        return self.checkpointer.extra_state()

    def load_param_shards(self, reader: ShardReader) -> None:
        """Collective: fill this rank's part (parameters, optimizer state, extras) from ``reader``."""
        self.checkpointer.load_param_shards(reader)

    # ------------------------------------------------------------------ end
    def teardown(self) -> None:
        """End of fit: finish communication in flight and release what only training needs. The
        model stays usable for evaluation, sampling and ``full_state_dict()`` afterwards."""

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds per category (working params, grads, master, optimizer state)."""
        from .memory import count_bytes
        return count_bytes(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(world_size={self.world_size})"

