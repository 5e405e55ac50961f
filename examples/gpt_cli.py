"""The demo GPT's part of the command line (``train.py``): the ``model`` group's schema, the checks
of the model against the data and the strategy, and the :class:`GPTModule` a composed config names.

It lives here, not in ``trainer/config.py``, because the library never imports ``examples/``: the
library's ``Config`` leaves ``model`` untyped, and ``train.py``, the demo application, brings the
GPT's pieces from this module. Messages read ``field=value: problem; valid: ...`` like the library's.
"""
from __future__ import annotations

import dataclasses

from hydra.core.config_store import ConfigStore

from ..trainer.config import Config, schema_name, world_size
from ..trainer.errors import ConfigError
from .gpt import GPTConfig
from .gpt_module import GPTModule


#: the model group's sizes: ``conf/model/<name>.yaml`` selects ``/schema_model_<name>`` (written here once;
#: the other fields keep GPTConfig's defaults)
SIZES = {
    "gpt_tiny": dict(block_size=64, n_layer=2, n_head=2, n_embd=64),  # ~0.2M parameters: smoke tests
    "gpt_small": dict(block_size=128, n_layer=4, n_head=4, n_embd=256),  # ~3.2M: the demo
    "gpt_21m": dict(block_size=256, n_layer=4, n_head=8, n_embd=512),  # the MACHINE_FACTS benchmark model
    "gpt_118m": dict(block_size=256, n_layer=8, n_head=16, n_embd=1024),  # communication-bound benchmark
}


def register_schema() -> None:
    """``schema_model_gpt`` and one ``schema_model_<size>`` per entry of :data:`SIZES` (GPTConfig with
    those defaults), which ``conf/model/*.yaml`` select, so Hydra rejects a misspelt or wrongly typed
    model key at compose time; ``GPTConfig.__post_init__`` checks the values when the composed config
    becomes objects."""
    cs = ConfigStore.instance()
    cs.store(name=schema_name("model", "gpt"), node=GPTConfig)
    for name, values in SIZES.items():
        node = dataclasses.make_dataclass(f"GPTConfig_{name}", [(k, int, dataclasses.field(default=v))
                                                                for k, v in values.items()], bases=(GPTConfig,))
        cs.store(name=schema_name("model", name), node=node)


def _bad(field: str, value, problem: str, valid: str) -> ConfigError:
    return ConfigError(f"{field}={value!r}: {problem}; valid: {valid}")


def pipeline_layers(model: GPTConfig) -> int:
    """Layers of the GPT as a pipeline (:meth:`GPT.pipeline_layers`): wte, positions, the blocks,
    ln_f, lm_head."""
    return model.n_layer + 4


def validate_pipeline(cfg: Config, world: int) -> int:
    """The pipeline's shape against the world, the GPT and the batch, before any rank starts;
    returns the data-parallel replicas (each of which reads its own share of the data)."""
    stages, m = cfg.strategy.stages or world, cfg.strategy.micro_batches
    if world % stages:
        raise _bad("strategy.stages", stages, f"does not divide the {world} processes (trainer.devices x "
                   "trainer.num_nodes): the world is stages x data-parallel replicas",
                   f"a divisor of {world}: " + ", ".join(str(d) for d in range(1, world + 1) if world % d == 0))
    layers = pipeline_layers(cfg.model)
    if stages > layers:
        raise _bad("strategy.stages", stages, f"exceeds the {layers} layers of the GPT as a pipeline "
                   f"(wte, positions, model.n_layer={cfg.model.n_layer} blocks, ln_f, lm_head): every stage "
                   "needs one", f"1 .. {layers}, or a deeper model")
    if cfg.model.pipeline_cut == "compute" and cfg.strategy.virtual_stages > 1:
        raise _bad("model.pipeline_cut", cfg.model.pipeline_cut, f"cuts {stages} stages, not the "
                   f"{stages * cfg.strategy.virtual_stages} chunks of strategy.virtual_stages="
                   f"{cfg.strategy.virtual_stages}", "'parameters' with virtual stages, or strategy.virtual_stages=1")
    if cfg.data.batch_size % m:
        raise _bad("data.batch_size", cfg.data.batch_size, f"is each replica's batch and must split into "
                   f"strategy.micro_batches={m} equal micro-batches", f"a multiple of {m}")
    return world // stages


def validate(cfg: Config) -> None:
    """What only the demo knows: its GPT reads bytes, a pipeline's shape fits the world, the GPT
    and the batch, and each data-parallel rank gets at least one full batch (the loader drops a
    partial one, so no step would ever run) and, with validation on, one held-out sequence. Run
    after ``cfg.validate()``, which checked each field."""
    model, data, world = cfg.model, cfg.data, world_size(cfg.trainer)
    if model.vocab_size < 256:
        raise _bad("model.vocab_size", model.vocab_size, "must be >= 256: the data are bytes", "256 or more")
    if world < 1:
        return  # the Trainer names the bad trainer.devices / trainer.num_nodes
    if getattr(cfg.strategy, "name", None) == "pipeline":
        world = validate_pipeline(cfg, world)  # the data are split over the replicas only
    chunk, size = model.block_size + 1, data.size()
    n_val = int(size * data.val_fraction)
    per_rank = -(-((size - n_val) // chunk) // world)  # the sampler pads the ranks to equal shares
    if per_rank < data.batch_size:
        raise _bad("data.batch_size", data.batch_size,
                   f"is more than the {per_rank} training sequence(s) each of the {world} rank(s) gets "
                   f"({size - n_val} training bytes in sequences of model.block_size+1={chunk})",
                   f"data.batch_size <= {per_rank}" if per_rank else
                   "more data (data.max_bytes, data.path) or a smaller model.block_size")
    if data.val_fraction and n_val < chunk:
        raise _bad("data.val_fraction", data.val_fraction,
                   f"holds out {n_val} bytes, fewer than one sequence of model.block_size+1={chunk}",
                   f">= {chunk / size:.4g}, or 0 for no validation")


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
#: terms (``trainer/tune.py``), to the peak RSS of the 21M GPT's 24-configuration sweep on 2 ranks
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
