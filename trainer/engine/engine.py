"""The Engine: zerotrain's strategies and precisions under a training loop the user writes.

A plain PyTorch loop becomes a distributed one by changing a few lines::

    engine = Engine(strategy="zero3", precision="bf16-mixed", devices=2)
    engine.launch()                                   # rank 0 starts ranks 1..N-1, or joins torchrun/SLURM
    with engine.init_module():                        # zero3: parameters partitioned as they are created
        model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model, optimizer = engine.setup(model, optimizer)
    loader = engine.setup_dataloaders(DataLoader(data, batch_size=8, shuffle=True))
    for i, (x, y) in enumerate(loader):
        with engine.no_backward_sync(model, enabled=(i + 1) % accum != 0):
            logits, loss = model(x, y)
            engine.backward(loss / accum)
        if (i + 1) % accum == 0:
            engine.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

Nothing here implements a strategy. The Engine calls the same ``Strategy`` interface as the
Trainer, in the same order (``strategies/base.py``): ``join_job`` (``job.py``) ->
``init_context`` -> ``setup_module`` -> ``setup_optimizer``; each forward runs through
``run_forward`` and the strategy's model (DDP's reducer, ZeRO-3's gather hooks); ``backward`` is
``Strategy.backward`` and ``optimizer.step()`` is ``Strategy.optimizer_step`` - the one written
sequence of gradient readiness, unscale/overflow check, clipping, inner step, parameter refresh
and zeroing. That is why ``clip_gradients`` only sets the bound for the next step: clipping
happens inside that sequence, after the gradients are unscaled and checked, where the strategy
(ZeRO: one all-reduce over the partitions) computes the norm. Checkpoints are the Trainer's
format, written and read by the same functions (``checkpointing.save_strategy`` /
``load_strategy``) with the Trainer's loop counters, so a checkpoint of either resumes in the other.

Limits, each from the Strategy interface: one model per strategy (a further ``setup`` gets a
strategy of its own, ``engine_models.py``; one checkpoint holds one model); several optimizers are held by
the strategy as one ``OptimizerSet`` (a parameter in several of them only where the strategy allows it), each
wrapper's ``step()`` stepping and zeroing its own parameters only; the pipeline strategy is refused (it runs its own
forward/backward schedule, which a user's loop cannot express). Every rank must build the model
from the same seed, as under the Trainer (ZeRO-1/2 take each rank's own values for its partition).

Is the Trainer a client of the Engine? Not now. The Trainer's loop needs things the Engine's
surface does not carry: ``Strategy.run_schedule`` with the Trainer's hooks (the pipeline's whole
schedule), ``skip_step`` for non-finite losses, the progress watchdog and elastic restarts around
each step, and callbacks in the checkpoint. Rebuilding the Trainer on the Engine would either
widen the Engine with all of these or split each between the two, and would put every Trainer
test at risk for no behaviour gained. Both are thin fronts over the same Strategy, so they share
code instead: ``job.py`` (joining the job, distributed samplers), ``checkpointing`` (the format)
and ``LoopState`` (the position a checkpoint resumes at).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from ...strategies import Strategy, progress
from ...strategies.optimizers import OptimizerSet
from ..checkpoint import protocol as checkpointing, reshard
from ..loop.compiled import take_compiled
from ..errors import ConfigError
from ..launch.job import check_cuda, check_num_nodes, distributed_loader, join_job, plugins
from ..launch.launcher import LocalLauncher
from ..loop.state import LoopState
from ..settings.declaration import ENGINE, canonical_accelerator, declared
from ..settings.run_options import device_count
from .models import another_strategy, backward_across
from .wrappers import EngineLoader, EngineModule, EngineOptimizer
from ..utilities import sampler_seed

log = logging.getLogger("zerotrain")


def _strategy_attr(name: str, doc: str) -> property:
    """A read-only attribute of the Engine that is its strategy's (valid after ``launch``)."""
    return property(lambda self: getattr(self._strategy, name), doc=doc)


class Engine:
    """One rank of a job running the user's own loop; see the module docstring."""

    @declared("Engine", ENGINE)  # the settings shared with the Trainer: types, defaults and checks
    def __init__(self, *, accelerator, devices, num_nodes, strategy, precision, seed) -> None:
        """The Trainer's arguments of the same names (``trainer/settings/declaration.py``). ``seed``:
        None (the default, as Fabric, which has no such argument: seed with ``seed_everything``)
        seeds nothing, and the DistributedSamplers of ``setup_dataloaders`` take the seed
        ``seed_everything`` recorded, else 0; an int seeds every rank's global RNGs with it at
        ``launch`` and orders the samplers, as the Trainer's does at set-up."""
        accelerator = canonical_accelerator(accelerator)
        self.devices, self.num_nodes = device_count(devices, accelerator), num_nodes
        check_cuda("Engine", accelerator, self.devices)
        check_num_nodes("Engine", self.num_nodes)
        self.accelerator, self.seed = accelerator, seed
        self.precision_plugin, self._strategy = plugins("Engine", strategy, precision, self.devices * num_nodes)
        self._specs = (strategy, precision)  # for the strategies of further models (engine_models.py)
        if self._strategy.runs_own_schedule:
            raise ConfigError(f"Engine: strategy={self._strategy.name!r} runs its own forward/backward "
                              "schedule, which a loop written by the user cannot drive; valid: a strategy "
                              "with one forward and one backward per batch (single, ddp, zero1, zero2, "
                              "zero3, offload), or the Trainer")
        #: the training position a checkpoint keeps (optimizer steps; epoch and batch of the first
        #: loader given to ``setup_dataloaders``), in the Trainer's counters
        self.progress = LoopState()
        self._launched = False
        self._launcher: LocalLauncher | None = None
        self._model: EngineModule | None = None
        self._optimizer: EngineOptimizer | None = None
        self._train_loader: EngineLoader | None = None
        self._optimizers: list[EngineOptimizer] = []  # one wrapper per optimizer given to setup
        self._models: list[EngineModule] = []  # every model set up (the first is ``_model``)

    # ------------------------------------------------------------------ the job
    def launch(self) -> None:
        """Collective: join the job (the Trainer's process model): without torchrun/SLURM a
        process asking for N > 1 devices becomes rank 0 and starts ranks 1..N-1 by re-running its
        command line, so the code after ``launch()`` runs on every rank. Idempotent; the other
        methods launch on first use."""
        if self._launched:
            return
        self._launcher = join_job(self._strategy, self.precision_plugin, self.accelerator, self.devices,
                                  self.num_nodes, seed=self.seed)
        self._launched = True

    @property
    def strategy(self) -> Strategy:
        return self._strategy

    global_rank = _strategy_attr("global_rank", "This process's rank in the job.")
    local_rank = _strategy_attr("local_rank", "This process's rank on its node.")
    world_size = _strategy_attr("world_size", "How many processes the job has.")
    is_global_zero = _strategy_attr("is_global_zero", "Whether this process is global rank 0.")
    device = _strategy_attr("device", "The device this rank computes on (batches go there).")

    # ------------------------------------------------------------------ model, optimizer, data
    @contextlib.contextmanager
    def init_module(self, empty_init: bool | None = None) -> Iterator[None]:
        """Build the model inside: under zero3 each parameter is partitioned as it is registered
        (never whole on any rank, equal to an eager build from the same seed); elsewhere a plain
        build. Create the optimizer after the block, on ``model.parameters()``. ``empty_init=True``
        (Fabric's) builds on the meta device where the strategy materializes at ``setup``
        (``meta_init``: ``ModelParallelStrategy``); elsewhere it changes nothing."""
        self.launch()
        meta = torch.device("meta") if empty_init and getattr(self._strategy, "meta_init", False) \
            else contextlib.nullcontext()
        with self._strategy.init_context(), meta:
            yield

    def setup(self, model: nn.Module, *optimizers: torch.optim.Optimizer) -> tuple[Any, ...]:
        """Collective: hand the model and its optimizer (built on ``model.parameters()``, not yet
        stepped) to the strategy; returns ``(model, optimizer)`` wrappers to use from now on: the
        model's forward runs through the strategy, the optimizer's ``step()`` is the strategy's."""
        self.launch()
        if not isinstance(model, nn.Module):
            raise ConfigError(f"Engine.setup: model={type(model).__name__}; valid: an nn.Module")
        s = self._strategy
        bare = not optimizers and s.evaluates_without_optimizer  # Fabric's setup(model): the model alone
        if not bare and (not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers)):
            raise ConfigError(
                f"Engine.setup: {len(optimizers)} optimizers given ({', '.join(type(o).__name__ for o in optimizers)}); "
                "valid: one or more torch.optim.Optimizer, built on the model's parameters (none: the "
                "model alone, under single or ddp)")
        if any(m.module is model for m in self._models):
            raise ConfigError("Engine.setup: called twice with the same model; valid: each model once (several "
                              "models: one setup call each)")
        if self._model is not None:  # one more model (Fabric's GAN): a strategy of its own
            s = another_strategy(s, *self._specs, self.precision_plugin, self.world_size)
        model = take_compiled(s, model, "Engine.setup")  # Fabric's setup(torch.compile(model)): per block
        try:
            s.setup_module(model)
            s.compile_module()
            if not bare:
                s.setup_optimizer(optimizers[0] if len(optimizers) == 1 else OptimizerSet(optimizers))
        except ValueError as exc:  # the strategy's checks (parameters outside the optimizer, ...)
            raise ConfigError(f"Engine.setup: {exc}") from None
        wrapped = EngineModule(s, model)
        if bare:
            self._models.append(wrapped)
            self._model = self._model if self._model is not None else wrapped
            return wrapped
        opts = [EngineOptimizer(self, o, k if len(optimizers) > 1 else None, s) for k, o in enumerate(optimizers)]
        self._models.append(wrapped)
        self._optimizers.extend(opts)
        if self._model is None:
            self._model, self._optimizer = wrapped, opts[0]
        return (wrapped, *opts)

    def setup_dataloaders(self, *loaders: Any, move_to_device: bool = True, use_distributed_sampler: bool = True) -> Any:
        """Each loader over a DistributedSampler (the Trainer's, same shuffle and ``seed``), its
        batches moved to ``device``, ``set_epoch`` called for each pass. A sampler of the user's own
        (``SubsetRandomSampler``, ...) is split over the ranks in its own order, not shuffled again
        (Fabric's ``DistributedSamplerWrapper``); ``use_distributed_sampler=False`` keeps every
        loader as it is. The first loader of the first call is the training loader: its position is
        saved by ``save`` and restored by ``load``. Returns one loader, or a list for several."""
        self.launch()
        if not loaders:
            raise ConfigError("Engine.setup_dataloaders: no loader given; valid: one or more DataLoaders")
        out = []
        for loader in loaders:
            tracked = self._train_loader is None
            # one data-parallel rank: the loader as it is (its own sampler and order), as Fabric
            sharded = (loader if self._strategy.data_parallel_world_size == 1 or not use_distributed_sampler
                       else distributed_loader(loader, self._strategy, sampler_seed(self.seed),
                                               custom_sampler_shuffle=False))
            wrapped = EngineLoader(sharded,
                                   self.device if move_to_device else None, self.progress if tracked else None)
            if tracked:
                self._train_loader = wrapped
            out.append(wrapped)
        return out[0] if len(out) == 1 else out

    # ------------------------------------------------------------------ the step
    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` as the strategy does it (loss scaling, gradient buffers and
        reductions). Divide the loss by the accumulation count yourself, as in plain PyTorch."""
        self._require_setup("backward")
        s = self._strategy
        if len(self._models) > 1:
            backward_across(loss, [(m._strategy, m.module) for m in self._models])
        # several optimizers: a forward may be followed by several backwards (DDP re-arms per loss)
        elif len(self._optimizers) == 1:
            s.backward(loss)
        else:
            s.manual_backward(loss)
        for o in self._optimizers:
            o.dirty = True

    def _after_optimizer_step(self, optimizer: EngineOptimizer) -> None:
        """Called by each optimizer wrapper after its step (``Fabric``: its callbacks' hook)."""

    def begin_external_backward(self) -> float:
        """For an autograd pass the caller started itself (``zerotrain.deepspeed`` accepts a plain
        ``loss.backward()`` as DeepSpeed does): the strategy's part before autograd, now. Returns
        the loss scale the caller multiplies the gradients entering the model by (the precision's
        loss scaling); call ``end_external_backward`` when autograd has finished."""
        self._require_setup("backward")
        return self._strategy.begin_user_backward()

    def end_external_backward(self) -> None:
        """The strategy's part after autograd (gradient reductions) for ``begin_external_backward``."""
        self._strategy.end_user_backward()
        for o in self._optimizers:
            o.dirty = True

    @contextlib.contextmanager
    def no_backward_sync(self, model: Any, enabled: bool = True) -> Iterator[None]:
        """Around the forward and backward of a micro-batch that only accumulates gradients
        (``enabled``): the strategy skips or defers the gradient communication (DDP's
        ``no_sync``, ZeRO's deferred reduction)."""
        self._check_model(model, "no_backward_sync")
        with self._resolve(model)._strategy.no_sync() if enabled else contextlib.nullcontext():
            yield

    def clip_gradients(self, model: Any, optimizer: Any, max_norm: float) -> None:
        """Clip the next ``optimizer.step()``'s gradients to a global L2 norm of ``max_norm``. The
        step clips, after it unscaled the gradients and checked them for overflow (the strategy's
        sequence): so this returns nothing, and is called once per step, before ``step()``."""
        self._clip_next_step(model, optimizer, "max_norm", max_norm)

    def _clip_next_step(self, model: Any, optimizer: Any, name: str, bound: Any,
                        error_if_nonfinite: bool = False) -> None:
        """Set ``optimizer``'s next step to clip: by global L2 norm (``name="max_norm"``) or
        element-wise by value (``name="clip_val"``), to ``bound``."""
        self._check_model(model, "clip_gradients")
        if not any(optimizer is o for o in self._optimizers):
            raise ConfigError(f"{type(self).__name__}.clip_gradients: optimizer is not one engine.setup "
                              "returned; valid: an optimizer wrapper from engine.setup(model, optimizer, ...)")
        if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not bound > 0:
            raise ConfigError(f"{type(self).__name__}.clip_gradients: {name}={bound!r}; valid: a number > 0")
        optimizer.clip_at = float(bound)
        optimizer.clip_by = "value" if name == "clip_val" else "norm"
        optimizer.clip_error_if_nonfinite = bool(error_if_nonfinite)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The precision's forward context (autocast under the mixed precisions) for computation
        outside the model's forward, e.g. a loss; the model's forward already runs in it."""
        return self._strategy.precision.forward_context(self.device.type)

    # ------------------------------------------------------------------ collectives
    def barrier(self) -> None:
        self._strategy.barrier()

    def all_reduce(self, value: torch.Tensor | float, op: str = "mean") -> torch.Tensor:
        """Collective: ``value`` summed, averaged or maxed over the ranks (``op``: sum, mean, max)."""
        return self._strategy.reduce(value, op=op)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Collective: every rank's ``tensor`` (same shape everywhere), stacked: shape
        ``(world_size, *tensor.shape)``."""
        t = torch.as_tensor(tensor).detach().to(self.device).contiguous()
        if not self._strategy.distributed:
            return t.unsqueeze(0)
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        progress.mark("all_gather (Engine.all_gather)")
        dist.all_gather(out, t)
        return torch.stack(out)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self._strategy.broadcast(obj, src)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on global rank 0 only."""
        if self.is_global_zero:
            print(*args, **kwargs)

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str, state: dict[str, Any], update_latest: bool = True) -> None:
        """Collective: write the checkpoint directory ``path`` in the Trainer's sharded format
        (every rank its shard; ``latest`` beside it names it, unless ``update_latest`` is False).
        ``state`` holds the model and optimizer from ``setup`` (under any keys) and anything else:
        objects with ``state_dict()`` (an LR scheduler: the Trainer resumes it too) and plain
        values (numbers, strings, tensors, lists and dicts of them)."""
        self._require_setup("save")
        self._one_model("save")
        user = {k: self._saved_value(k, v) for k, v in state.items() if not self._is_setup_object(v)}
        scheds = [v for v in state.values() if isinstance(v, torch.optim.lr_scheduler.LRScheduler)]
        loader = self._train_loader

        def engine_meta(meta: dict[str, Any]) -> None:  # rank 0: the Trainer's keys, and the user's
            meta.update(loop=self.progress.state_dict(), callbacks={}, engine=user,
                        scheduler=scheds[0].state_dict() if len(scheds) == 1 else None,
                        data={"batch_size": loader.batch_size if loader is not None else None,
                              "world": self._strategy.data_parallel_world_size})

        checkpointing.save_strategy(self._strategy, self._strategy.optimizer, path, engine_meta, update_latest)

    def load(self, path: str, state: dict[str, Any]) -> dict[str, Any]:
        """Collective: load a checkpoint written by the Engine or the Trainer, with any strategy on
        any world size (resharded as the Trainer does), into the model and optimizer in ``state``;
        the other entries are restored in place (``load_state_dict`` for objects, the saved value
        for plain ones; an LR scheduler from a Trainer's checkpoint gets its scheduler). The
        training loader resumes at the saved position, the RNG states are restored. Returns the
        saved entries ``state`` did not ask for."""
        self._require_setup("load")
        self._one_model("load")
        s = self._strategy
        meta = checkpointing.load_strategy(s, s.optimizer, path)
        loop, note = reshard.resume_position(meta.get("loop", {}), meta.get("data"),
                                             getattr(self._train_loader, "batch_size", None),
                                             s.data_parallel_world_size)
        if note:
            log.warning("resume: %s", note)
        self.progress.load_state_dict(loop)
        self.progress.end_saved_epoch()  # saved at a Trainer's epoch end: the next epoch
        self.progress.continue_cut_epoch()  # a Trainer's fit that max_steps cut: its epoch's remaining batches
        saved = meta.get("engine", {})
        for key, obj in state.items():
            if self._is_setup_object(obj):
                continue
            value = saved.get(key)
            if value is None and isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
                value = meta.get("scheduler")
            if value is None:
                log.warning("Engine.load: %s has no entry %r; it is left as it is", path, key)
            elif hasattr(obj, "load_state_dict"):
                obj.load_state_dict(value)
            else:
                state[key] = value
        checkpointing.restore_or_reseed(s, meta.get("rng", []), path, self.seed, self.progress.global_step)
        s.barrier()
        return {k: v for k, v in saved.items() if k not in state}

    def _is_setup_object(self, obj: Any) -> bool:
        return any(self._resolve(obj) is m for m in self._models) or any(obj is o for o in self._optimizers)

    def _resolve(self, model: Any) -> Any:
        """The model wrapper ``model`` stands for (Fabric's ``setup_module`` returns a stand-in)."""
        return model

    def _saved_value(self, key: str, value: Any) -> Any:
        if isinstance(value, (EngineModule, EngineOptimizer, nn.Module, torch.optim.Optimizer)):
            raise ConfigError(f"Engine.save: state[{key!r}] is a {type(value).__name__} that engine.setup "
                              "did not return; valid: the model and optimizer from engine.setup, objects "
                              "with state_dict() and plain values")
        return value.state_dict() if hasattr(value, "state_dict") else value

    # ------------------------------------------------------------------ checks
    def _require_setup(self, what: str) -> None:
        if self._model is None:
            raise ConfigError(f"Engine.{what}: called before engine.setup(model, optimizer); valid: set up "
                              "the model and optimizer first")

    def _one_model(self, what: str) -> None:
        if len(self._models) > 1:
            raise ConfigError(f"Engine.{what}: {len(self._models)} models set up; valid: one (the checkpoint "
                              "format holds one strategy's model: put the networks in one nn.Module to save them)")

    def _check_model(self, model: Any, what: str) -> None:
        self._require_setup(what)
        if not any(self._resolve(model) is m for m in self._models):
            raise ConfigError(f"Engine.{what}: model is not the one engine.setup returned; valid: the model "
                              "wrapper from engine.setup(model, optimizer)")
