"""GPTModule: the demo TrainModule, a byte-level GPT trained on the standard library's source
(or any text file), with AdamW and a warmup + cosine learning-rate schedule."""
from __future__ import annotations

import functools
import math

import torch
from torch.utils.data import DataLoader

from ..strategies.parallel import vocab_parallel_cross_entropy
from ..strategies.parallel.tensor_plan import is_cut
from ..strategies.pipeline import PipelineModule
from ..trainer.api.module import TrainModule
from .data import ByteDataset, decode, encode, load_text, split_train_val
from .gpt import GPT, GPTConfig, lm_loss


def warmup_cosine(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier at optimizer step ``step`` (0-based): linear warmup ``(step + 1) /
    (warmup_steps + 1)`` for the first ``warmup_steps`` steps, 1.0 at ``warmup_steps``, then a
    cosine down to ``min_lr_ratio`` at ``max_steps`` and flat after it."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if step >= max_steps:
        return min_lr_ratio
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class GPTModule(TrainModule):
    """A :class:`GPT` with its optimizer, schedule and data.

    The model is built in :meth:`configure_model`, not here, so a sharded strategy can build it
    on the meta device. The pipeline strategy then calls :meth:`to_pipeline`, which replaces it by
    its layers cut into stages. The text is read on the first data hook call and kept on the instance.
    ``val_fraction=0`` turns validation off (``val_dataloader()`` returns None).
    """

    def __init__(
        self,
        config: GPTConfig | None = None,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 20,
        max_steps: int = 200,
        min_lr_ratio: float = 0.1,
        batch_size: int = 16,
        data_path: str | None = None,
        max_bytes: int = 8_000_000,
        val_fraction: float = 0.1,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr!r}")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
        if not 0 <= warmup_steps <= max_steps or max_steps <= 0:
            raise ValueError(
                f"need 0 <= warmup_steps <= max_steps and max_steps > 0, got "
                f"warmup_steps={warmup_steps!r}, max_steps={max_steps!r}"
            )
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio!r}")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size!r}")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers!r}")
        self.config = config if config is not None else GPTConfig()
        self.lr = lr
        self.weight_decay = weight_decay
        self.betas = tuple(betas)
        self.warmup_steps = warmup_steps
        self.max_steps = max_steps
        self.min_lr_ratio = min_lr_ratio
        self.batch_size = batch_size
        self.data_path = data_path
        self.max_bytes = max_bytes
        self.val_fraction = val_fraction
        self.num_workers = num_workers
        self.model: GPT | None = None  # built by configure_model()
        self._splits: tuple[bytes, bytes] | None = None  # (train, val) bytes, read on first use
        self._flops_per_token: float | None = None

    # ---- model
    def configure_model(self) -> None:
        # Idempotent: a strategy may call it (under a meta-device context) after the user did.
        if self.model is None:
            self.model = GPT(self.config)

    def to_pipeline(self, num_stages: int) -> PipelineModule:
        """The pipeline strategy's hook: ``self.model`` becomes a PipelineModule of the built GPT's
        layers (:meth:`GPT.pipeline_layers`, cut by parameters; with ``config.pipeline_cut="compute"``
        :meth:`GPT.pipeline_cut`'s balanced cut; the LM head tied to ``wte`` across the first and last
        stage) with the GPT's loss; the strategy keeps this rank's stage and drops the rest.

        Why here and not in the library: the pipeline cannot know how a model is a sequence of
        layers, and the library never imports ``examples/``; the TrainModule that owns the model
        does. Built from the model ``configure_model`` made, so its initial weights are the GPT's
        under the same seed whatever the number of stages (and those of every other strategy),
        at the cost of holding the whole model once while set-up runs."""
        model = self._require_model()
        if not isinstance(model, PipelineModule):
            layers, method = (model.pipeline_cut(num_stages) if model.config.pipeline_cut == "compute"
                              else (model.pipeline_layers(), "parameters"))
            self.model = PipelineModule.from_modules(layers, num_stages, loss_fn=self.logits_loss,
                                                     partition_method=method)
        return self.model

    def logits_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The GPT's mean cross-entropy; from vocabulary-sharded logits (the strategy's
        ``tensor_parallel`` cut the LM head by ``GPT.tp_plan``) the vocabulary-parallel one over its
        tensor group, which never gathers them."""
        if logits.size(-1) == self.config.vocab_size:
            return lm_loss(logits, targets)
        return vocab_parallel_cross_entropy(logits, targets, self.trainer.strategy.mesh_group("tensor"))

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if isinstance(self.model.lm_head, torch.nn.Linear):  # not cut by a tensor-parallel strategy
            return self.model(x, y)[1]
        return self.logits_loss(self.model(x)[0], y)  # the logits are this rank's part of the vocabulary

    def _require_model(self) -> GPT:
        if self.model is None:
            raise RuntimeError(
                f"{type(self).__name__}.model is not built yet; call configure_model() first "
                f"(the Trainer does this during setup)"
            )
        return self.model

    # ---- steps
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self._loss(x, y)
        self.log("train_loss", loss.detach(), prog_bar=True)
        if isinstance(self.model, GPT):  # the MoE GPT's aux loss, dropped tokens and expert load (this rank's)
            for name, value in self.model.moe_stats().items():
                self.log(name, value)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self._loss(x, y)
        self.log("val_loss", loss.detach(), prog_bar=True, sync_dist=True)  # the mean over every rank's batches
        return loss

    # ---- optimization
    def configure_optimizers(self) -> dict:
        """AdamW with weight decay on matrices (dim >= 2: Linear weights, embeddings) and none on
        vectors (LayerNorm weights, biases), and a per-step warmup + cosine schedule."""
        self._require_model()
        # named_parameters() yields the tied wte/lm_head weight once.
        params = [p for _, p in self.named_parameters() if p.requires_grad]
        # the MoE GPT's experts (marked allreduce=False) in groups of their own, after the dense
        # ones: ZeRO partitions each kind over its own process group
        experts = [p for p in params if getattr(p, "allreduce", True) is False]
        dense = [p for p in params if getattr(p, "allreduce", True) is not False]
        decay = [p for p in dense if p.dim() >= 2]
        no_decay = [p for p in dense if p.dim() < 2]
        # Both groups always, even empty: a pipeline stage may hold no vectors (wte and wpe alone),
        # and every stage's optimizer and LR schedule must have the plain model's two groups for
        # checkpoints to move between layouts (the schedule's state is rank 0's).
        groups = [{"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        if experts:
            groups += [g for g in ({"params": [p for p in experts if p.dim() >= 2], "weight_decay": self.weight_decay},
                                   {"params": [p for p in experts if p.dim() < 2], "weight_decay": 0.0}) if g["params"]]
        fusable = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
        optimizer = None
        if fusable:
            try:
                optimizer = torch.optim.AdamW(groups, lr=self.lr, betas=self.betas, fused=True)
            except (RuntimeError, ValueError):  # dtype/device this build's fused kernel lacks
                optimizer = None
        if optimizer is None:
            optimizer = torch.optim.AdamW(groups, lr=self.lr, betas=self.betas)
        # A partial of a module-level function (not a lambda) so the scheduler can be pickled.
        schedule = functools.partial(
            warmup_cosine,
            warmup_steps=self.warmup_steps,
            max_steps=self.max_steps,
            min_lr_ratio=self.min_lr_ratio,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ---- data
    def _train_val_bytes(self) -> tuple[bytes, bytes]:
        if self._splits is None:
            data = load_text(self.data_path, self.max_bytes)
            self._splits = split_train_val(data, self.val_fraction)
        return self._splits

    def train_dataloader(self) -> DataLoader:
        train, _ = self._train_val_bytes()
        return DataLoader(
            ByteDataset(train, self.config.block_size),
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=True,
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader | None:
        if self.val_fraction == 0:
            return None
        _, val = self._train_val_bytes()
        return DataLoader(
            ByteDataset(val, self.config.block_size),
            batch_size=self.batch_size,
            shuffle=False,
            drop_last=False,
            num_workers=self.num_workers,
        )

    # ---- accounting
    def flops_per_sample(self) -> float:
        """Training FLOPs per sample of ``block_size`` tokens. Counted on a meta-device copy of
        the config, so it is right whether or not ``self.model`` is built, or sharded."""
        if self._flops_per_token is None:
            with torch.device("meta"):
                self._flops_per_token = GPT(self.config).flops_per_token()
        return self._flops_per_token * self.config.block_size

    def tokens_per_sample(self) -> int:
        return self.config.block_size

    def activation_bytes(self, micro_batch: int, checkpointing: bool, precision: str) -> int:
        """``zerotrain-tune``'s hook: one micro-batch's activation memory (``gpt_cli.activation_bytes``)."""
        from .gpt_cli import activation_bytes

        return activation_bytes(self.config, micro_batch, checkpointing, precision)

    # ---- sampling
    @torch.no_grad()
    def sample(
        self, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8, top_k: int | None = 40
    ) -> str:
        """``prompt`` followed by ``max_new_tokens`` sampled bytes, decoded as text. Runs the model
        in eval mode and restores its previous mode. Pipelined, it is a collective: the stages'
        weights are gathered into one GPT on global rank 0, which samples, and every rank
        returns its text."""
        model = self._require_model()
        if not prompt:
            raise ValueError("sample needs a non-empty prompt (the model has no start token)")
        if isinstance(model, PipelineModule) or is_cut(model):  # gathered whole on rank 0
            whole = self._gathered_gpt()
            text = None if whole is None else self._sample_with(whole, prompt, max_new_tokens, temperature, top_k)
            return self.trainer.strategy.broadcast(text)
        return self._sample_with(model, prompt, max_new_tokens, temperature, top_k)

    def _gathered_gpt(self) -> GPT | None:
        """Collective: the pipelined (or tensor-parallel) model as one GPT on global rank 0 (None
        elsewhere), from the full state dict, which the pipeline names as the GPT does."""
        state = self.trainer.full_state_dict()
        if not state:
            return None
        with torch.device("meta"):
            gpt = GPT(self.config)
        gpt.load_state_dict({k.removeprefix("model."): v for k, v in state.items()}, assign=True)
        gpt.tie_weights()
        return gpt.to(next(self.parameters()).device)

    def _sample_with(self, model: GPT, prompt: str, max_new_tokens: int, temperature: float,
                     top_k: int | None) -> str:
        device = next(model.parameters()).device
        idx = encode(prompt).unsqueeze(0).to(device)
        was_training = model.training
        model.eval()
        try:
            out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k)
        finally:
            model.train(was_training)
        return decode(out[0].cpu())
