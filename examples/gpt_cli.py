"""The demo GPT's part of the command line (``zerotrain-train``) that builds things: the
:class:`GPTModule` a composed config names (:func:`cli_module`, the ``_target_`` of the demo's
``model`` options) and the GPT's memory numbers for ``zerotrain-tune``.

The schema, the sizes and the checks of the model against the data (no model code) are the
library's, in ``trainer/command/demo_gpt.py``, re-exported here; the library never imports ``examples/``,
and ``train.py`` reaches this module only through the ``_target_`` string, as it reaches a user's.
"""
from __future__ import annotations

from ..trainer.command.config import Config
from ..trainer.command.demo_gpt import (DEMO_TARGET, SIZES, GPTConfig, pipeline_layers,  # noqa: F401
                                      register_schema, validate, validate_pipeline)
from ..trainer.errors import ConfigError
from .gpt_module import GPTModule


def build_module(cfg: Config) -> GPTModule:
    """The GPTModule with the optimizer and data sections' values; its own checks become ConfigErrors.
    Warmup is capped at ``trainer.max_steps`` so a short run keeps the default warmup."""
    try:
        return GPTModule(config=cfg.model, lr=cfg.optimizer.lr, weight_decay=cfg.optimizer.weight_decay,
                         betas=tuple(cfg.optimizer.betas),
                         warmup_steps=min(cfg.optimizer.warmup_steps, cfg.trainer.max_steps),
                         max_steps=cfg.trainer.max_steps, min_lr_ratio=cfg.optimizer.min_lr_ratio,
                         batch_size=cfg.data.batch_size, data_path=cfg.data.path, max_bytes=cfg.data.max_bytes,
                         val_fraction=cfg.data.val_fraction, num_workers=cfg.data.num_workers)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def cli_module(cli_config: Config) -> GPTModule:
    """The demo's ``_target_``: ``train.py`` calls a target that takes ``cli_config`` with the whole
    composed config (the GPT reads the optimizer, data and trainer sections too)."""
    return build_module(cli_config)


# ---------------------------------------------------------------------- memory, for zerotrain-tune
def num_params(model: GPTConfig) -> int:
    """The GPT's parameter count, exact: built on the meta device (no memory), the tied head once."""
    import torch

    from .gpt import GPT

    with torch.device("meta"):
        gpt = GPT(model)
    return sum(p.numel() for p in gpt.parameters())  # parameters() yields a shared Parameter once


#: floats a block holds per token at the peak of its backward: what autograd saved (the LayerNorm
#: inputs 2d, qkv 3d, attention's output d, the projections' inputs 2d, the MLP's hidden 4d before and
#: after GELU) plus the gradients being formed and the allocator's slack. 16 and the logits' 2.8 x
#: vocab (logits, log-softmax, their gradient) are fitted, with zerotrain-tune's in-flight and step
#: terms (``trainer/command/tune_search.py``), to the peak RSS of the 21M GPT's 24-configuration sweep on 2 ranks
#: (vocab 16384, micro-batches 2 and 4: the estimate 0.88-1.00x of each measured peak)
_PEAK_PER_BLOCK, _PEAK_PER_VOCAB = 16, 2.8


def activation_bytes(model: GPTConfig, micro_batch: int, checkpointing: bool, precision: str) -> int:
    """Activation memory of one micro-batch's forward and backward. Checkpointed blocks keep only
    their input and recompute one block at a time. Embeddings, the final LayerNorm and the logits
    come on top. Under autocast most saved tensors are 2 bytes; this counts 2 for every precision
    but ``32``."""
    tokens, d = micro_batch * model.block_size, model.n_embd
    block = _PEAK_PER_BLOCK * d + model.n_head  # + attention's log-sum-exp per head
    # checkpointed: every block's input, and at once the block being recomputed and the one whose
    # gradients are being formed
    blocks = (model.n_layer * d + 2 * block) if checkpointing else model.n_layer * block
    per_token = blocks + 3 * d + _PEAK_PER_VOCAB * model.vocab_size
    return int(tokens * per_token * (4 if precision == "32" else 2))
