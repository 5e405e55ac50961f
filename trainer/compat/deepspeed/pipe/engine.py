"""``PipelineEngine``: what ``deepspeed.initialize(model=PipelineModule(...))`` returns, driving
zerotrain's pipeline strategy (``strategies/pipeline``: its schedule, point-to-point exchange,
tie and data-parallel reductions, clipping and step; nothing of a pipeline is run here).

DeepSpeed 0.19.8's semantics, as this engine keeps them:

* the world is ``num_stages`` x data-parallel replicas; ``train_batch_size`` =
  ``train_micro_batch_size_per_gpu`` x ``gradient_accumulation_steps`` x replicas, and a batch is
  ``gradient_accumulation_steps`` micro-batches (``micro_batches``);
* ``train_batch(data_iter=None)`` draws the micro-batches ``(inputs, labels)`` from the iterator on
  the first and the last stage only (the middle stages read nothing), runs every forward and
  backward (each micro-batch's loss divided by their number), reduces tied gradients (sum) and
  the data-parallel gradients (mean), clips to ``gradient_clipping`` (DeepSpeed's default 1.0),
  steps the optimizer and the LR scheduler, and returns the mean loss over the micro-batches and
  replicas on every rank;
* ``training_data`` given to ``initialize`` becomes a loader of micro-batches over a
  DistributedSampler of the replicas without shuffling, repeated endlessly (DeepSpeed's), used
  when ``train_batch`` gets no iterator;
* ``eval_batch(data_iter)`` runs the forward of ``micro_batches`` micro-batches without gradients
  and returns their mean loss on every rank; the training iterator is kept;
* ``forward``/``backward``/``step`` are refused: the schedule runs them (DeepSpeed raises too).

Clipping follows DeepSpeed's norm: in fp32 without ZeRO, DeepSpeed's ``clip_fp32_gradients``
counts only the parameters of model-parallel rank 0, which for a pipeline is the first stage, and
scales every stage's gradients by that norm's coefficient; so does this engine
(``PipelineStrategy.norm_stages``). Under ZeRO-1 or fp16/bf16 the strategy's norm over all stages
is used (DeepSpeed's optimizers there are not checked against it).

Deliberate differences (README "Coming from DeepSpeed"): ``eval_batch`` weighs micro-batches of
unequal size by their rows; checkpoints are zerotrain's sharded format, as for the other engine.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, DistributedSampler

from ....checkpoint import directory as checkpoint_io, protocol as checkpointing
from ....errors import ConfigError
from ....launch.job import join_job
from .....strategies.pipeline import PipelineStrategy
from .. import comm
from ..config import DeepSpeedConfig, parse, report_ignored
from ..engine import ConfigAccessors
from ..utils import RepeatingLoader
from .module import PipelineModule

log = logging.getLogger("zerotrain")

_ONLY_BATCHES = ("PipelineEngine.{call}(): only train_batch() and eval_batch() are accessible in pipeline mode "
                 "(DeepSpeed's rule: the schedule runs every forward, backward and step)")


def _to(value: Any, device: torch.device) -> Any:
    if torch.is_tensor(value):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return tuple(_to(v, device) for v in value)
    raise ConfigError(f"PipelineEngine: a batch holds {type(value).__name__}; valid: tensors or tuples of them")


class PipelineEngine(ConfigAccessors):
    """DeepSpeed's pipeline engine over a :class:`PipelineStrategy`; see the module docstring."""

    def __init__(self, strategy: PipelineStrategy, cfg: DeepSpeedConfig, model: PipelineModule, optimizer: Any,
                 lr_scheduler: Any) -> None:
        super().__init__()
        self.module = model
        self._s, self._cfg = strategy, cfg
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        self.micro_batches = cfg.gradient_accumulation_steps
        self.micro_batch_size = cfg.train_micro_batch_size_per_gpu
        self.num_stages, self.stage_id = strategy.num_stages, strategy.stage
        self.global_steps = self.global_samples = self.micro_steps = self.skipped_steps = 0
        self.training_dataloader: Any = None
        self.data_iterator: Iterator[Any] | None = None
        self.batch_fn: Callable[[Any], Any] | None = None
        self.agg_train_loss: torch.Tensor | None = None

    @property
    def zerotrain_strategy(self) -> PipelineStrategy:
        return self._s

    global_rank = property(lambda self: self._s.global_rank)
    local_rank = property(lambda self: self._s.local_rank)
    world_size = property(lambda self: self._s.world_size)
    dp_world_size = property(lambda self: self._s.data_parallel_world_size)
    device = property(lambda self: self._s.device)

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def get_pipeline_parallel_rank(self) -> int:
        return self.stage_id

    def is_gradient_accumulation_boundary(self) -> bool:
        """False: reductions and the step happen inside ``train_batch`` only."""
        return False

    # ------------------------------------------------------------------ data
    def _reads_data(self) -> bool:
        return self.is_first_stage() or self.is_last_stage()

    def set_dataloader(self, loader: Any) -> None:
        if self._reads_data():
            self.training_dataloader = loader
            self.data_iterator = iter(loader)

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        if self._reads_data():
            self.training_dataloader = None
            self.data_iterator = iterator

    def set_batch_fn(self, fn: Callable[[Any], Any]) -> None:
        self.batch_fn = fn

    def _build_data_iter(self, dataset: Any, collate_fn: Callable | None) -> None:
        if not isinstance(dataset, torch.utils.data.Dataset) or not hasattr(dataset, "__len__"):
            raise ConfigError(f"initialize: training_data={type(dataset).__name__}; valid: a map-style "
                              "torch.utils.data.Dataset (with __len__)")
        sampler = DistributedSampler(dataset, num_replicas=self.dp_world_size, rank=self._s.data_parallel_rank,
                                     shuffle=False)
        loader = DataLoader(dataset, batch_size=self.micro_batch_size, sampler=sampler, collate_fn=collate_fn,
                            drop_last=self._cfg.dataloader_drop_last, pin_memory=self.device.type == "cuda")
        self.set_dataloader(RepeatingLoader(loader))

    def _next_micro_batches(self, count: int, call: str) -> tuple[list[Any], list[Any]]:
        """``count`` micro-batches' inputs and labels on the stages that read them (placeholders
        elsewhere)."""
        if not self._reads_data():
            return [None] * count, [None] * count
        if self.data_iterator is None:
            raise ConfigError(f"PipelineEngine.{call}: no data on stage {self.stage_id}; valid: {call}(data_iter) "
                              "or initialize(training_data=...)")
        inputs, labels = [], []
        for _ in range(count):
            batch = next(self.data_iterator)
            if self.batch_fn is not None:
                batch = self.batch_fn(batch)
            if not isinstance(batch, (tuple, list)) or len(batch) != 2:
                raise ConfigError(f"PipelineEngine.{call}: a micro-batch is {type(batch).__name__}"
                                  + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
                                  + "; valid: (inputs, labels)")
            inputs.append(_to(batch[0], self.device))
            labels.append(_to(batch[1], self.device) if self.is_last_stage() else None)
        return inputs, labels

    # ------------------------------------------------------------------ the batches
    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """One optimizer step over ``micro_batches`` micro-batches; the mean loss on every rank."""
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled. Use eval_batch() instead.")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        inputs, labels = self._next_micro_batches(self.micro_batches, "train_batch")
        loss = self._s.run_micro_batches(inputs, labels, train=True)
        clip = self._cfg.gradient_clipping
        stepped = self._s.optimizer_step(gradient_clip_val=clip if clip > 0 else None)
        if not stepped:
            self.skipped_steps += 1
        elif self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        self.micro_steps += self.micro_batches
        every = self.steps_per_print()
        if self.global_rank == 0 and every and self.global_steps % every == 0:
            log.info("steps: %d loss: %.4f", self.global_steps, float(loss))
        self.agg_train_loss = loss
        return loss

    def eval_batch(self, data_iter: Iterator[Any], return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str | None = "avg", bcast_loss: bool = True,
                   num_micro_batches: int | None = None) -> torch.Tensor:
        """The mean loss of ``num_micro_batches`` (default ``micro_batches``) micro-batches from
        ``data_iter``, without gradients, on every rank; the training iterator is kept."""
        refused = {"return_logits": (return_logits, False), "compute_loss": (compute_loss, True),
                   "reduce_output": (reduce_output, "avg")}
        for name, (value, valid) in refused.items():
            if value != valid:
                raise ConfigError(f"PipelineEngine.eval_batch: {name}={value!r}; valid: {valid!r} (the mean loss "
                                  "of the micro-batches)")
        count = self.micro_batches if num_micro_batches is None else num_micro_batches
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ConfigError(f"PipelineEngine.eval_batch: num_micro_batches={num_micro_batches!r}; valid: an "
                              "integer >= 1 or None")
        self.module.eval()
        kept, kept_loader = self.data_iterator, self.training_dataloader
        self.set_dataiterator(data_iter)
        try:
            inputs, labels = self._next_micro_batches(count, "eval_batch")
            with torch.no_grad():
                return self._s.run_micro_batches(inputs, labels, train=False)
        finally:
            self.data_iterator, self.training_dataloader = kept, kept_loader

    # ------------------------------------------------------------------ refused
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError(_ONLY_BATCHES.format(call="forward"))

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError(_ONLY_BATCHES.format(call="backward"))

    def step(self, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError(_ONLY_BATCHES.format(call="step"))

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, save_dir: str | os.PathLike, tag: Any = None, client_state: dict[str, Any] = {},
                        save_latest: bool = True) -> bool:
        """Collective: zerotrain's sharded checkpoint (the Trainer's format, the plain model's
        names: it resumes on other stage counts and strategies) in ``save_dir/tag`` (default
        ``global_step<N>``), ``save_dir/latest`` naming it unless ``save_latest`` is False; the
        counters, the LR scheduler and ``client_state`` (plain values) go with it."""
        tag = f"global_step{self.global_steps}" if tag is None else str(tag)
        sched = self.lr_scheduler if hasattr(self.lr_scheduler, "state_dict") else None
        counters = {"global_steps": self.global_steps, "global_samples": self.global_samples,
                    "skipped_steps": self.skipped_steps}

        def meta(m: dict[str, Any]) -> None:
            m.update(loop={}, scheduler=sched.state_dict() if sched is not None else None,
                     engine={"client_state": dict(client_state), "deepspeed_counters": counters})

        checkpointing.save_strategy(self._s, self._s.optimizer, os.path.join(os.fspath(save_dir), tag), meta,
                                    update_latest=save_latest)
        return True

    def load_checkpoint(self, load_dir: str | os.PathLike, tag: Any = None) -> tuple[str | None, Any]:
        """Collective: load ``load_dir/tag`` (default: what ``latest`` names; none: a warning and
        ``(None, None)``, as DeepSpeed). Returns ``(checkpoint directory, client_state)``."""
        path = checkpoint_io.read_latest(load_dir) if tag is None else os.path.join(os.fspath(load_dir), str(tag))
        if path is None:
            log.warning("load_checkpoint: %s has no 'latest' file; nothing loaded", load_dir)
            return None, None
        meta = checkpointing.load_strategy(self._s, self._s.optimizer, os.fspath(path))
        if hasattr(self.lr_scheduler, "load_state_dict") and meta.get("scheduler") is not None:
            self.lr_scheduler.load_state_dict(meta["scheduler"])
        saved = meta.get("engine") or {}
        counters = saved.get("deepspeed_counters", {})
        self.global_steps = counters.get("global_steps", 0)
        self.global_samples = counters.get("global_samples", self.global_steps * self.train_batch_size())
        self.skipped_steps = counters.get("skipped_steps", 0)
        self._s.barrier()
        return os.fspath(path), saved.get("client_state", {})

    def destroy(self) -> None:
        self._s.teardown()

    def __repr__(self) -> str:
        return f"PipelineEngine({self._s!r}, stage={self.stage_id})"


def initialize(source: Any, model: PipelineModule, optimizer: Any, model_parameters: Any, training_data: Any,
               lr_scheduler: Any, collate_fn: Callable | None) -> tuple[PipelineEngine, Any, Any, Any]:
    """``deepspeed.initialize`` for a ``PipelineModule`` (after ``comm.init_distributed``)."""
    from .. import _optimizer, _scheduler
    from ..accelerator import get_accelerator

    world = comm.get_world_size()
    cfg = parse(source, world // model.num_stages)  # the batch arithmetic counts replicas, not ranks
    if cfg.zero_stage >= 2 or cfg.strategy == "offload":
        raise ConfigError(f"zero_optimization.stage={cfg.zero_stage} ({cfg.strategy}) with a PipelineModule; valid: "
                          "stage 0 or 1 without offload (DeepSpeed: ZeRO-2 and ZeRO-3 are incompatible with "
                          "pipeline parallelism)")
    pipeline = cfg.raw.get("pipeline") or {}
    interval = pipeline.get("activation_checkpoint_interval", 0) if isinstance(pipeline, dict) else 0
    strategy = PipelineStrategy(stages=model.num_stages, micro_batches=cfg.gradient_accumulation_steps,
                                activation_checkpointing=bool(interval or model.activation_checkpoint_interval),
                                zero_stage=cfg.zero_stage)
    if cfg.precision == "32" and cfg.zero_stage == 0:  # DeepSpeed's clip_fp32_gradients: the first stage's norm
        strategy.norm_stages = (0,)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    join_job(strategy, cfg.make_precision(), get_accelerator().device_name(), local, max(1, world // local))
    if strategy.is_global_zero:
        report_ignored(cfg)
    opt = _optimizer(cfg, optimizer, model, model_parameters)
    strategy.setup_module(model)
    strategy.setup_optimizer(opt)
    sched = _scheduler(cfg, lr_scheduler, opt, optimizer)
    engine = PipelineEngine(strategy, cfg, model, opt, sched)
    if training_data is not None:
        engine._build_data_iter(training_data, collate_fn)
    return engine, opt, engine.training_dataloader, sched
