"""``DeepSpeedEngine``: DeepSpeed's engine surface over a :class:`zerotrain.Engine`.

DeepSpeed's loop calls ``engine(batch)``, ``engine.backward(loss)`` and ``engine.step()`` once per
micro-batch; the engine keeps the accumulation count. Here that count decides, per micro-batch,
what the zerotrain Engine is asked to do:

* ``backward`` divides the loss by ``gradient_accumulation_steps`` (DeepSpeed's ``scale_wrt_gas``)
  and runs the strategy's backward; a micro-batch before the boundary runs forward and backward
  inside the strategy's ``no_backward_sync`` (communication deferred to the boundary);
* ``step`` at the boundary clips to ``gradient_clipping`` and runs the strategy's step (the
  Engine's optimizer wrapper), then the LR scheduler unless an fp16 overflow skipped the step,
  and counts ``global_steps``/``global_samples``/``skipped_steps``; every call counts a micro-step.

A plain ``loss.backward()`` on what the engine's forward returned works as in DeepSpeed 0.19:
hooks on the forward's outputs divide the gradients entering the model by the accumulation count
(and apply the fp16 loss scale) and run the strategy's parts before and after autograd
(``Engine.begin_external_backward``/``end_external_backward``).

Checkpoints are zerotrain's sharded format (``Engine.save``/``Engine.load``: readable by the
Trainer and the Engine, on any world size), under ``save_dir/tag`` with DeepSpeed's ``latest``
file beside it; the engine's counters and ``client_state`` travel in it.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any, Iterator, Mapping

import torch
from torch import nn

from ....strategies.offload.aio import atomic_file
from ...checkpoint import directory as checkpoint_io
from . import comm
from .utils import tensor_fragment
from .compiled import CompileMethods
from ...engine.engine import Engine
from ...errors import CheckpointError, ConfigError
from .config import DeepSpeedAssertion, DeepSpeedConfig
from .ops import fp32_clip, zero_clip
from .ops.stage3_tail import use_deepspeed_tail
from .zero_init import use_module_boundaries, use_stage3_linear

log = logging.getLogger("zerotrain")


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in a forward's output (nested tuples, lists, dicts, Hugging Face outputs)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _config_value(attr: str) -> Any:
    """An accessor method returning the parsed config's ``attr``."""
    def accessor(self: "DeepSpeedEngine") -> Any:
        return getattr(self._cfg, attr)

    accessor.__name__ = attr
    return accessor


class _Monitor:
    """``steps_per_print``, ``wall_clock_breakdown`` and ``tensorboard``: what DeepSpeed reports
    per optimizer step, written by global rank 0."""

    def __init__(self, cfg: DeepSpeedConfig, rank: int) -> None:
        self.cfg, self.rank = cfg, rank
        self.times = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        self.losses: list[float] = []
        self.writer = None
        if cfg.tensorboard_dir and rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            os.makedirs(cfg.tensorboard_dir, exist_ok=True)
            self.writer = SummaryWriter(log_dir=cfg.tensorboard_dir)

    @contextlib.contextmanager
    def timed(self, what: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.times[what] += time.perf_counter() - start

    def loss(self, value: torch.Tensor) -> None:
        if self.writer is not None:
            self.losses.append(float(value.detach().float().mean()))

    def stepped(self, steps: int, samples: int, lrs: list[float], skipped: int, loss_scale: float | None) -> None:
        if self.writer is not None:
            if self.losses:
                self.writer.add_scalar("Train/Samples/train_loss", sum(self.losses) / len(self.losses), samples)
            self.writer.add_scalar("Train/Samples/lr", lrs[0], samples)
            if loss_scale is not None:
                self.writer.add_scalar("Train/Samples/loss_scale", loss_scale, samples)
            self.writer.flush()
        self.losses = []
        every = self.cfg.steps_per_print
        if self.rank == 0 and every and steps % every == 0:
            log.info("step=%d, skipped=%d, lr=%s", steps, skipped, lrs)
            if self.cfg.wall_clock_breakdown:
                log.info("time (ms) | forward: %.2f | backward: %.2f | step: %.2f (sums over the last %d steps)",
                         *(1000 * t for t in self.times.values()), every)
        if every and steps % every == 0:
            self.times = dict.fromkeys(self.times, 0.0)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class _DirectCallsUnderAutocast:
    """fp16/bf16: DeepSpeed casts the module itself to the 16-bit type, so scripts cast their
    inputs (``inputs.half()``) and may call the module directly, e.g. to evaluate
    (``net(images.half())``). zerotrain's module keeps fp32 weights and its forward runs under the
    precision's autocast; these hooks on the module run a direct call (one outside the engine's
    forward) under the same autocast, so it computes in the 16-bit type and returns 16-bit
    outputs, as DeepSpeed's module would, instead of failing on fp32 weights meeting 16-bit
    inputs. A call inside an autocast (the engine's forward) is left alone. ``remove`` undoes it."""

    def __init__(self, module: nn.Module, precision: Any, device_type: str) -> None:
        self.precision, self.device_type = precision, device_type
        self._entered: list[Any] = []  # one per call in progress: the autocast entered, or None
        self.handles = [module.register_forward_pre_hook(self._enter),
                        module.register_forward_hook(self._exit, always_call=True)]

    def _enter(self, module: nn.Module, args: Any) -> None:
        if torch.is_autocast_enabled(self.device_type):
            self._entered.append(None)
            return
        ctx = self.precision.forward_context(self.device_type)
        ctx.__enter__()
        self._entered.append(ctx)

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        ctx = self._entered.pop() if self._entered else None
        if ctx is not None:
            ctx.__exit__(None, None, None)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


class ConfigAccessors(nn.Module):
    """DeepSpeed's config accessors (methods, as DeepSpeed's), for both engines (this module's and
    ``pipe/engine.py``'s), each holding the parsed config as ``_cfg`` and its ``optimizer``."""

    _cfg: DeepSpeedConfig
    optimizer: Any

    @property
    def config(self) -> dict[str, Any]:
        return self._cfg.raw

    train_batch_size = _config_value("train_batch_size")
    train_micro_batch_size_per_gpu = _config_value("train_micro_batch_size_per_gpu")
    gradient_accumulation_steps = _config_value("gradient_accumulation_steps")
    gradient_clipping = _config_value("gradient_clipping")
    zero_optimization_stage = _config_value("zero_stage")
    fp16_enabled = _config_value("fp16_enabled")
    bfloat16_enabled = _config_value("bf16_enabled")
    steps_per_print = _config_value("steps_per_print")
    wall_clock_breakdown = _config_value("wall_clock_breakdown")

    def zero_optimization(self) -> bool:
        return self._cfg.zero_stage > 0

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]


class DeepSpeedEngine(CompileMethods, ConfigAccessors):
    """What ``deepspeed.initialize`` returns first. An ``nn.Module`` holding the user's model as
    ``module`` (so ``engine.parameters()``, ``engine.train()``/``eval()`` work as DeepSpeed's)."""

    def __init__(self, engine: Engine, cfg: DeepSpeedConfig, model: Any, optimizer: Any, lr_scheduler: Any,
                 training_dataloader: Any) -> None:
        super().__init__()
        self.module = model.module
        self._zt, self._cfg, self._model = engine, cfg, model
        self.optimizer, self.lr_scheduler, self.training_dataloader = optimizer, lr_scheduler, training_dataloader
        self.global_steps = self.global_samples = self.micro_steps = self.skipped_steps = 0
        self._boundary: bool | None = None  # set_gradient_accumulation_boundary's override
        self._deferring: contextlib.ExitStack | None = None  # the no_backward_sync of this micro-batch
        self._in_backward = False
        self._external_scale: float | None = None  # set while a plain loss.backward() runs
        self._step_applied = False
        self._inside_no_sync = False
        #: the reduced gradients are readable (``deepspeed.utils.safe_get_full_grad``): from the
        #: boundary's backward to its step; ``_local_grads``: a backward since then did not reduce
        #: (before the boundary, or inside no_sync)
        self._fresh_grads = self._local_grads = False
        tensor_fragment.register(self)
        self._monitor = _Monitor(cfg, engine.global_rank)
        self._comms = comm.record(self) if cfg.comms_logger else None
        # DeepSpeed's stage 3 computes every F.linear with its own function (zero_init.Stage3Linear)
        zero = cfg.raw.get("zero_optimization") or {}
        self._stage3_linear = cfg.zero_stage == 3 and bool(zero.get("memory_efficient_linear", True))
        if self._stage3_linear:  # for this model's layers only, in forward and in any recomputation
            use_stage3_linear(self.module.parameters())
        if cfg.zero_stage == 3:  # its module hooks' autograd identities; its host Adam's scalar tail
            use_module_boundaries(self.module)
            use_deepspeed_tail(engine.strategy, cfg.raw)
        precision = engine.strategy.precision  # ZeRO 1-3 bf16: a bf16 module without autocast (ops/bf16_module.py)
        self._direct_calls = (_DirectCallsUnderAutocast(self.module, precision, engine.device.type)
                              if precision.autocast_dtype is not None else None)

    # ------------------------------------------------------------------ identity and config
    @property
    def zerotrain_engine(self) -> Engine:
        """The :class:`zerotrain.Engine` underneath (its strategy, ``full_state_dict``, ...)."""
        return self._zt

    global_rank = property(lambda self: self._zt.global_rank)
    local_rank = property(lambda self: self._zt.local_rank)
    world_size = property(lambda self: self._zt.world_size)
    dp_world_size = property(lambda self: self._zt.strategy.data_parallel_world_size)
    device = property(lambda self: self._zt.device)

    @property
    def loss_scale(self) -> float:
        return self._zt.strategy.precision.loss_scale

    def was_step_applied(self) -> bool:
        return self._step_applied

    # ------------------------------------------------------------------ accumulation
    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self._boundary = bool(is_boundary)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DeepSpeed's: defer gradient communication. As in DeepSpeed, refused under ZeRO 2/3, inside
        another ``no_sync``, and ``step()`` is refused inside it (each a :class:`DeepSpeedAssertion`)."""
        if self._cfg.zero_stage >= 2:
            raise DeepSpeedAssertion(
                f"DeepSpeedEngine.no_sync: zero_optimization.stage={self._cfg.zero_stage}: the no_sync context manager "
                "is incompatible with gradients partitioned as they are produced; valid: stage 0 or 1")
        if self._inside_no_sync:
            raise DeepSpeedAssertion("DeepSpeedEngine.no_sync: inside no_sync already (no_sync context manager reentry "
                                     "is unsupported, as in DeepSpeed); valid: one with-block at a time")
        self._inside_no_sync = True
        try:
            with self._zt.no_backward_sync(self._model):
                yield
        finally:
            self._inside_no_sync = False

    # ------------------------------------------------------------------ forward, backward, step
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.module.training and torch.is_grad_enabled():
            self._defer_if_accumulating()
        dtype = self._cfg.torch_autocast_dtype  # DeepSpeed's torch_autocast section
        with self._monitor.timed("forward"), (torch.autocast(self.device.type, dtype=dtype) if dtype is not None
                                               else contextlib.nullcontext()):
            out = self._model(*args, **kwargs)
        for t in _tensors(out):
            if t.requires_grad:
                t.register_hook(self._output_grad)
        return out

    def _defer_if_accumulating(self) -> None:
        """A micro-batch before the boundary: forward and backward inside the strategy's
        ``no_backward_sync`` (entered here, left after its backward)."""
        if self._deferring is None and not self.is_gradient_accumulation_boundary():
            stack = contextlib.ExitStack()
            stack.enter_context(self._zt.no_backward_sync(self._model))
            self._deferring = stack

    def _end_deferral(self) -> None:
        if self._deferring is not None:
            stack, self._deferring = self._deferring, None
            stack.close()

    def _output_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The hook on each output of a forward. Under ``engine.backward`` the strategy scaled the
        loss already. Under a plain ``loss.backward()`` (DeepSpeed 0.19 accepts it): the first
        output gradient starts the strategy's backward, every output gradient is divided by
        ``gradient_accumulation_steps`` (and multiplied by the fp16 loss scale), which is what
        dividing the loss would do, and the strategy's part after autograd runs when autograd ends."""
        if self._in_backward:
            return grad
        if self._external_scale is None:
            self._external_scale = (self._zt.begin_external_backward() * self._sequence_scale()
                                    / self.gradient_accumulation_steps())
            torch.autograd.Variable._execution_engine.queue_callback(self._end_external_backward)
        return grad * self._external_scale

    def _sequence_scale(self) -> int:
        """ALST (a sequence axis): DeepSpeed divides the gradients summed over data x sequence by
        the data-parallel size (world / sp), the strategy by every replica (world): the loss is
        taken sp times."""
        return self._zt.strategy.mesh_size("sequence")

    def _end_external_backward(self) -> None:
        self._external_scale = None
        self._zt.end_external_backward()
        self._fresh_grads = self._deferring is None and not self._inside_no_sync
        self._local_grads = not self._fresh_grads
        self._end_deferral()

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """The strategy's backward of ``loss / gradient_accumulation_steps`` (``scale_wrt_gas``);
        returns that divided loss, as DeepSpeed does."""
        if retain_graph:
            raise ConfigError("DeepSpeedEngine.backward: retain_graph=True; valid: False (the strategy frees each "
                              "micro-batch's graph with its gradient buffers)")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ConfigError(f"DeepSpeedEngine.backward: loss={type(loss).__name__}; valid: a scalar tensor")
        scaled = loss / self.gradient_accumulation_steps() if scale_wrt_gas else loss
        self._monitor.loss(loss)
        self._in_backward = True
        sp = self._sequence_scale()
        if getattr(self._zt.strategy, "last_backward_wins", False):
            # DeepSpeed's ZeRO-1 reduces at the boundary only, also for a module called directly
            # (not through this engine's forward, which defers already)
            self._defer_if_accumulating()
        try:
            with self._monitor.timed("backward"):
                self._zt.backward(scaled * sp if sp > 1 else scaled)
            self._fresh_grads = self._deferring is None and not self._inside_no_sync
            self._local_grads = not self._fresh_grads
        finally:
            self._in_backward = False
            self._end_deferral()
        return scaled

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """At the accumulation boundary: clip, the strategy's step, the LR scheduler (not after a
        skipped fp16 step). Every call counts one micro-step."""
        if self._inside_no_sync:
            raise DeepSpeedAssertion("DeepSpeedEngine.step: It is illegal to call Engine.step() inside no_sync context "
                                     "manager (as in DeepSpeed); valid: step after the with-block")
        self._end_deferral()
        self._step_applied = False
        if self.is_gradient_accumulation_boundary():
            with self._monitor.timed("step"):
                self._take_step(lr_kwargs)
            self._fresh_grads = self._local_grads = False
        self.micro_steps += 1

    #: bf16 at stage 0: DeepSpeed's 16-bit optimizer wrapper's clip (``ops/sixteen_bit.py``)
    sixteen_bit: Any = None

    def clip_bytes(self) -> int | None:
        """All-reduce bytes one step's clip by norm moves, for the comms logger's formula: DeepSpeed's
        norm order at ZeRO 1-3 where ``zero_clip`` applies, else the strategy's own; None without
        clipping, and at stage 0 (its formula leaves the clip out)."""
        if self._cfg.gradient_clipping <= 0 or self._cfg.zero_stage == 0 or self.sixteen_bit is not None:
            return None
        if zero_clip.applies(self):
            return zero_clip.norm_bytes(self)
        norm_bytes = getattr(self._zt.strategy, "grad_norm_bytes", None)
        return norm_bytes() if norm_bytes is not None else None

    def _take_step(self, lr_kwargs: dict[str, Any] | None) -> None:
        if self.sixteen_bit is not None:
            if self.sixteen_bit.clip():
                self._step_applied = bool(self.optimizer.step())
            else:  # a non-finite norm: the wrapper skips the step
                self.optimizer.zero_grad()
        else:
            if self._cfg.gradient_clipping > 0 and fp32_clip.applies(self):  # DeepSpeed's arithmetic (stage 0)
                fp32_clip.clip(self.module, self._cfg.gradient_clipping)
            elif self._cfg.gradient_clipping > 0 and not (zero_clip.applies(self) and zero_clip.clip(self)):
                # (ZeRO 1-3: DeepSpeed's arithmetic where zero_clip applies; else, or a non-finite norm, ours)
                self._zt.clip_gradients(self._model, self.optimizer, max_norm=self._cfg.gradient_clipping)
            self._step_applied = bool(self.optimizer.step())
        if not self._step_applied:
            self.skipped_steps += 1
        elif self.lr_scheduler is not None:
            self.lr_scheduler.step(**(lr_kwargs or {}))
        self.global_steps += 1
        if self._comms is not None:
            self._comms.step = self.global_steps
        self.global_samples += self.train_batch_size()
        scale = self.loss_scale if self.fp16_enabled() else None
        self._monitor.stepped(self.global_steps, self.global_samples, self.get_lr(), self.skipped_steps, scale)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()
        self._fresh_grads = self._local_grads = False

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_state(self, client_state: Mapping[str, Any], scheduler: bool = True) -> dict[str, Any]:
        state: dict[str, Any] = {"model": self._model, "optimizer": self.optimizer, "client_state": dict(client_state),
                                 "deepspeed_counters": {"global_steps": self.global_steps,
                                                        "global_samples": self.global_samples,
                                                        "skipped_steps": self.skipped_steps}}
        if scheduler and hasattr(self.lr_scheduler, "state_dict"):
            state["lr_scheduler"] = self.lr_scheduler
        return state

    def save_checkpoint(self, save_dir: str | os.PathLike, tag: Any = None, client_state: Mapping[str, Any] = {},
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """Collective: zerotrain's sharded checkpoint in ``save_dir/tag`` (default tag
        ``global_step<N>``, as DeepSpeed's), ``save_dir/latest`` naming it unless ``save_latest`` is
        False. ``client_state`` (plain values: numbers, strings, tensors, lists and dicts of them) is
        given back by ``load_checkpoint``."""
        if exclude_frozen_parameters:
            raise ConfigError("DeepSpeedEngine.save_checkpoint: exclude_frozen_parameters=True; valid: False "
                              "(zerotrain's checkpoint holds every parameter)")
        tag = f"global_step{self.global_steps}" if tag is None else str(tag)
        self._end_deferral()
        self._zt.save(os.path.join(os.fspath(save_dir), tag), self._checkpoint_state(client_state),
                      update_latest=save_latest)
        return True

    def load_checkpoint(self, load_dir: str | os.PathLike, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None) -> tuple[str | None, Any]:
        """Collective: load ``load_dir/tag`` (default: the tag ``latest`` names; none: a warning and
        ``(None, None)``, as DeepSpeed) written by this engine, the zerotrain Engine or the Trainer,
        on any world size. Returns ``(checkpoint directory, client_state)``."""
        refused = {"load_module_strict": (load_module_strict, True),
                   "load_optimizer_states": (load_optimizer_states, True),
                   "load_module_only": (load_module_only, False), "custom_load_fn": (custom_load_fn, None)}
        for name, (value, valid) in refused.items():
            if value != valid:
                raise ConfigError(f"DeepSpeedEngine.load_checkpoint: {name}={value!r}; valid: {valid!r} (a zerotrain "
                                  "checkpoint restores the model and its optimizer state together)")
        if tag is None:
            path = checkpoint_io.read_latest(load_dir)
            if path is None:
                log.warning("load_checkpoint: %s has no 'latest' file; nothing loaded", load_dir)
                return None, None
        else:
            path = os.path.join(os.fspath(load_dir), str(tag))
        self._end_deferral()
        state = self._checkpoint_state({}, scheduler=load_lr_scheduler_states)
        generators = checkpoint_io.rng_state()  # DeepSpeed's load leaves the random generators alone
        self._zt.load(os.fspath(path), state)
        checkpoint_io.set_rng_state(generators)
        counters = state["deepspeed_counters"]
        self.global_steps, self.skipped_steps = counters["global_steps"], counters["skipped_steps"]
        self.global_samples = counters.get("global_samples", self.global_steps * self.train_batch_size())
        return os.fspath(path), state["client_state"]

    def save_16bit_model(self, save_dir: str | os.PathLike, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Collective: the whole model's weights as one ``torch.save``d state dict on global rank 0,
        in the config's 16-bit type (fp32 without fp16/bf16)."""
        full = self._model.full_state_dict()
        error = None
        if self.global_rank == 0:
            dtype = torch.float16 if self.fp16_enabled() else torch.bfloat16 if self.bfloat16_enabled() else None
            if dtype is not None:
                full = {k: v.to(dtype) if v.is_floating_point() else v for k, v in full.items()}
            target = os.path.join(os.fspath(save_dir), save_filename)
            try:  # all or nothing (temporary file, fsync, rename): a crash leaves the old file whole
                os.makedirs(save_dir, exist_ok=True)
                with atomic_file(target) as fd, open(fd, "wb", closefd=False) as f:
                    torch.save(full, f)
            except OSError as exc:
                error = f"rank 0: writing {exc.filename or target}: {exc.strerror or exc}"
        error = self._zt.broadcast(error)  # every rank learns the outcome: none waits on a failed one
        if error:
            raise CheckpointError(f"save_16bit_model({os.fspath(save_dir)!r}) failed: {error}")
        return True

    def destroy(self) -> None:
        """Release what training holds (the strategy's teardown; TensorBoard's writer)."""
        self._end_deferral()
        self._monitor.close()
        if self._direct_calls is not None:
            self._direct_calls.remove()
        if self.sixteen_bit is not None and self.sixteen_bit.forward is not None:
            self.sixteen_bit.forward.remove()
        if self._comms is not None:
            comm.stop_recording(self._comms)
        self._zt.strategy.teardown()

    def __repr__(self) -> str:
        return f"DeepSpeedEngine({self._zt.strategy.name}, {self.module!r})"
