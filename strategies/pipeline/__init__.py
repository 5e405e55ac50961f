"""Pipeline parallelism: layers cut into stages on different processes, micro-batches streamed
through them on a 1F1B or GPipe schedule, optionally times data-parallel replicas.

``module.py`` (PipelineModule, LayerSpec, TiedLayerSpec), ``partition.py`` (pure stage cuts),
``schedule.py`` (pure instruction lists: GPipe, 1F1B, interleaved 1F1B), ``simulate.py`` (all
stages' lists run together: deadlock freedom, bubble, live activations), ``topology.py`` (pure rank
grid), ``p2p.py`` (headers and batched sends/receives), ``stage.py`` (runs one stage's
instructions), ``collectives.py`` (gradient and weight reductions), ``zero1.py`` (ZeRO-1 over a
stage's replicas), ``strategy.py`` (the Strategy the Trainer talks to).

May import: strategies, ops, trainer.errors."""
from .config import PipelineConfig
from .module import LayerSpec, PipelineModule, Tie, TiedLayerSpec
from .schedule import SCHEDULES
from .strategy import PipelineStrategy
from .topology import PipelineGrid

__all__ = ["LayerSpec", "PipelineConfig", "PipelineModule", "PipelineStrategy", "PipelineGrid", "SCHEDULES", "Tie",
           "TiedLayerSpec"]
