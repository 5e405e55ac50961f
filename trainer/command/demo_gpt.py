"""The demo GPT's part of ``zerotrain-train`` that needs no model code: :class:`GPTConfig` (the
GPT's shape, the ``model`` group's schema), the sizes ``conf/model/gpt_*.yaml`` select, and the checks
of the model against the data and the strategy that run before any rank starts.

It is in the library, not in ``examples/``, because ``train.py`` composes and checks the config
before it builds anything and the library never imports ``examples/``. The GPT itself, its data and
its TrainModule stay in ``examples/``: the schema's ``_target_`` names the function that builds the
module (``zerotrain.examples.gpt_cli.cli_module``), which ``train.py`` calls through Hydra as it
calls a user's own ``_target_``. Messages read ``field=value: problem; valid: ...``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hydra.core.config_store import ConfigStore

from .config import schema_name, world_size
from ..errors import ConfigError

#: what builds the demo's TrainModule from the composed config (``train.py`` instantiates it)
DEMO_TARGET = "zerotrain.examples.gpt_cli.cli_module"


@dataclass
class GPTConfig:
    """Shape of a :class:`GPT`. ``vocab_size=256`` is byte-level text."""

    vocab_size: int = 256
    block_size: int = 128  # longest context the model sees (size of the position table)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    dropout: float = 0.0
    bias: bool = False  # biases in Linear and LayerNorm layers
    #: how the pipeline strategy cuts this model into stages (:meth:`GPTModule.to_pipeline`):
    #: "parameters" (between blocks, by parameter count: DeepSpeed's default) or "compute"
    #: (:meth:`GPT.pipeline_cut`: by estimated compute, a block split where a bound falls inside)
    pipeline_cut: str = "parameters"
    #: with ``strategy.tensor_parallel``: the sequence-parallel plan (``GPT.tp_plan_sequence_parallel``:
    #: norms, dropouts and the residual stream cut along the sequence over the tensor group)
    tp_sequence_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd={self.n_embd} must be divisible by GPTConfig.n_head={self.n_head}; "
                f"pick n_embd as a multiple of n_head"
            )
        if self.pipeline_cut not in ("parameters", "compute"):
            raise ValueError(f"GPTConfig.pipeline_cut={self.pipeline_cut!r}; valid: 'parameters', 'compute'")
        if not isinstance(self.tp_sequence_parallel, bool):
            raise ValueError(f"GPTConfig.tp_sequence_parallel must be a bool, got {self.tp_sequence_parallel!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")


@dataclass
class GPTMoEConfig(GPTConfig):
    """The demo GPT with a mixture of experts (``zerotrain.moe.MoE``, DeepSpeed-MoE's layer) as the
    MLP of every ``moe_every``-th block (blocks ``moe_every - 1``, ``2 * moe_every - 1``, ...; 1:
    every block, 2: every other). ``num_experts`` copies of the block's MLP, ``k`` (1 or 2) of them
    per token, ``capacity_factor`` (slots per expert: ``tokens / num_experts * capacity_factor * k``,
    at least ``min_capacity``; the rest dropped) unless ``drop_tokens=False``; ``ep_size`` ranks
    share the experts (expert parallelism: it divides ``num_experts`` and the world).
    ``aux_loss_coef`` times the layers' summed load-balancing loss is added to the loss."""

    num_experts: int = 4
    k: int = 1
    capacity_factor: float = 1.0
    min_capacity: int = 4
    drop_tokens: bool = True
    ep_size: int = 1
    moe_every: int = 1
    aux_loss_coef: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_experts", "ep_size", "moe_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTMoEConfig.{name} must be a positive int, got {value!r}")
        if self.k not in (1, 2) or self.k > self.num_experts:
            raise ValueError(f"GPTMoEConfig.k={self.k!r}; valid: 1, 2 (at most num_experts={self.num_experts})")
        if self.num_experts % self.ep_size:
            raise ValueError(f"GPTMoEConfig.ep_size={self.ep_size} does not divide num_experts={self.num_experts}; "
                             f"valid: " + ", ".join(str(d) for d in range(1, self.num_experts + 1)
                                                    if self.num_experts % d == 0))
        if self.moe_every > self.n_layer:
            raise ValueError(f"GPTMoEConfig.moe_every={self.moe_every} leaves no MoE block among "
                             f"n_layer={self.n_layer}; valid: 1 .. {self.n_layer}")
        if not self.capacity_factor > 0:
            raise ValueError(f"GPTMoEConfig.capacity_factor must be > 0, got {self.capacity_factor!r}")
        if self.min_capacity < 0 or self.aux_loss_coef < 0:
            raise ValueError(f"GPTMoEConfig.min_capacity={self.min_capacity!r}, aux_loss_coef={self.aux_loss_coef!r}; "
                             "valid: both >= 0")

    def is_moe_block(self, index: int) -> bool:
        """Whether block ``index`` (0-based) has the MoE as its MLP."""
        return index % self.moe_every == self.moe_every - 1


#: the model group's sizes: ``conf/model/<name>.yaml`` selects ``/schema_model_<name>`` (written here once;
#: the other fields keep GPTConfig's defaults)
SIZES = {
    "gpt_tiny": dict(block_size=64, n_layer=2, n_head=2, n_embd=64),  # ~0.2M parameters: smoke tests
    "gpt_small": dict(block_size=128, n_layer=4, n_head=4, n_embd=256),  # ~3.2M: the demo
    "gpt_21m": dict(block_size=256, n_layer=4, n_head=8, n_embd=512),  # the MACHINE_FACTS benchmark model
    "gpt_118m": dict(block_size=256, n_layer=8, n_head=16, n_embd=1024),  # communication-bound benchmark
}
#: the MoE variants (:class:`GPTMoEConfig`), selected as ``model=gpt_moe_tiny`` the same way
MOE_SIZES = {
    "gpt_moe_tiny": dict(block_size=64, n_layer=2, n_head=2, n_embd=64, num_experts=4),  # smoke tests
    "gpt_moe_small": dict(block_size=128, n_layer=4, n_head=4, n_embd=256, num_experts=8, moe_every=2),
}


def register_schema() -> None:
    """``schema_model_gpt`` and one ``schema_model_<size>`` per entry of :data:`SIZES` (GPTConfig with
    those defaults), which ``conf/model/gpt_*.yaml`` select, so Hydra rejects a misspelt or wrongly
    typed model key at compose time; ``GPTConfig.__post_init__`` checks the values when the composed
    config becomes objects. Each has a ``_target_`` field, :data:`DEMO_TARGET`, which builds the module."""
    cs = ConfigStore.instance()
    target = [("_target_", str, dataclasses.field(default=DEMO_TARGET))]
    cs.store(name=schema_name("model", "gpt"),
             node=dataclasses.make_dataclass("GPTConfig_cli", target, bases=(GPTConfig,)))
    for base, sizes_of in ((GPTConfig, SIZES), (GPTMoEConfig, MOE_SIZES)):
        for name, values in sizes_of.items():
            sizes = [(k, type(v), dataclasses.field(default=v)) for k, v in values.items()]
            node = dataclasses.make_dataclass(f"{base.__name__}_{name}", sizes + target, bases=(base,))
            cs.store(name=schema_name("model", name), node=node)


def _bad(field: str, value, problem: str, valid: str) -> ConfigError:
    return ConfigError(f"{field}={value!r}: {problem}; valid: {valid}")


def pipeline_layers(model: GPTConfig) -> int:
    """Layers of the GPT as a pipeline (:meth:`GPT.pipeline_layers`): wte, positions, the blocks,
    ln_f, lm_head."""
    return model.n_layer + 4


def validate_pipeline(cfg: Any, world: int) -> int:
    """The pipeline's shape against the world, the GPT and the batch, before any rank starts;
    returns the data-parallel replicas (each of which reads its own share of the data). With
    ``strategy.tensor_parallel`` each stage is that many ranks."""
    tensor = getattr(cfg.strategy, "tensor_parallel", 1)
    if isinstance(tensor, int) and tensor >= 1 and world % tensor == 0:  # else the strategy names it
        world //= tensor
    if tensor != 1 and getattr(cfg.model, "tp_sequence_parallel", False):
        raise _bad("model.tp_sequence_parallel", True, "is not built for the pipeline (its stages pass activations "
                   "replicated over the tensor group)", "false with strategy=pipeline")
    stages, m = cfg.strategy.stages or world, cfg.strategy.micro_batches
    if world % stages:
        raise _bad("strategy.stages", stages, f"does not divide the {world} processes (trainer.devices x "
                   "trainer.num_nodes" + (f" / strategy.tensor_parallel={tensor}" if tensor > 1 else "")
                   + "): the world is stages x data-parallel replicas",
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


def validate_tensor(cfg: Any, world: int) -> int:
    """``strategy.tensor_parallel`` against the world and the GPT, whose plan (``GPT.tp_plan``) cuts
    its heads and its vocabulary over the tensor group; returns the ranks that read distinct data
    (the world over the tensor and sequence axes)."""
    tensor = getattr(cfg.strategy, "tensor_parallel", 1)
    inner = tensor * getattr(cfg.strategy, "sequence_parallel", 1)
    if not isinstance(inner, int) or inner < 1 or world % inner:
        return world  # the strategy names the option (before any rank starts)
    if tensor == 1:
        return world // inner
    model = cfg.model
    if isinstance(model, GPTMoEConfig):
        raise _bad("strategy.tensor_parallel", tensor, "does not cut the MoE GPT (GPT.tp_plan is the dense "
                   "GPT's: its experts are not planned)", "1 with the MoE GPT")
    cut = [(name, getattr(model, name)) for name in ("n_head", "vocab_size") if getattr(model, name) % tensor]
    if cut:
        fits = [d for d in range(1, world + 1) if not (world % d or model.n_head % d or model.vocab_size % d)]
        raise _bad("strategy.tensor_parallel", tensor, f"does not divide model.{cut[0][0]}={cut[0][1]} (the GPT's "
                   "tensor-parallel plan cuts its heads and its vocabulary)", ", ".join(map(str, fits)))
    if getattr(model, "tp_sequence_parallel", False) and model.block_size % tensor:  # the samples' length
        raise _bad("model.block_size", model.block_size, f"does not cut into strategy.tensor_parallel={tensor} "
                   "sequence shards (model.tp_sequence_parallel)", f"a multiple of {tensor}")
    return world // inner


def validate_moe(cfg: Any, world: int) -> None:
    """The MoE GPT's expert parallelism against the world: ``model.ep_size`` ranks share the experts,
    so it divides the world (and ``model.num_experts``, checked by GPTMoEConfig); the pipeline
    (whose stages compute the plain loss, without the aux loss) does not take it."""
    model = cfg.model
    if world % model.ep_size:
        raise _bad("model.ep_size", model.ep_size, f"does not divide the {world} processes (trainer.devices x "
                   "trainer.num_nodes): the world is ep_size x expert-data-parallel replicas",
                   "a divisor of both " + f"{world} and model.num_experts={model.num_experts}: " + ", ".join(
                       str(d) for d in range(1, world + 1) if world % d == 0 and model.num_experts % d == 0))
    if getattr(cfg.strategy, "name", None) == "pipeline":
        raise _bad("strategy", "pipeline", "does not train the MoE GPT (its stages compute the loss without "
                   "the experts' aux loss)", "ddp, zero1, zero2, zero3")


def validate(cfg: Any) -> None:
    """What only the demo knows: its GPT reads bytes, a pipeline's shape fits the world, the GPT
    and the batch, and each data-parallel rank gets at least one full batch (the loader drops a
    partial one, so no step would ever run) and, with validation on, one held-out sequence. Run
    after ``cfg.validate()``, which checked each field."""
    model, data, world = cfg.model, cfg.data, world_size(cfg.trainer)
    if model.vocab_size < 256:
        raise _bad("model.vocab_size", model.vocab_size, "must be >= 256: the data are bytes", "256 or more")
    if world < 1:
        return  # the Trainer names the bad trainer.devices / trainer.num_nodes
    if isinstance(model, GPTMoEConfig):
        validate_moe(cfg, world)
    if getattr(cfg.strategy, "name", None) == "pipeline":
        validate_tensor(cfg, world)
        world = validate_pipeline(cfg, world)  # the data are split over the replicas only
    else:
        world = validate_tensor(cfg, world)  # the data are split over the data axis only
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
