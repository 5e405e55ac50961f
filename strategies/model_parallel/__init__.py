"""Lightning's ``ModelParallelStrategy`` (issue 45): the user's own torch parallelism on a named
device mesh. ``strategy.py`` (the Strategy: torch's ``DeviceMesh`` with the dimensions
``"data_parallel"`` and ``"tensor_parallel"``, ``configure_model`` run on it, the DTensor module
trained as it is; Fabric's form, ``FabricModelParallelStrategy(parallelize_fn, ...)``), ``checkpoint.py`` (its checkpoint adapter: DTensors saved whole in zerotrain's
reshardable format and cut back to this rank's shards at a load). How it sits beside the strategies'
own ``tensor_parallel=``: strategies/README.md, "Lightning's ModelParallelStrategy".

May import: strategies, trainer.errors."""
from .strategy import FabricModelParallelStrategy, ModelParallelStrategy

__all__ = ["FabricModelParallelStrategy", "ModelParallelStrategy"]
