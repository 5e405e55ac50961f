"""``zerotrain.deepspeed.pipe``: DeepSpeed's pipeline API (``import deepspeed.pipe`` ported by the
import swap) on zerotrain's pipeline strategy. ``PipelineModule`` (``module.py``) cuts and builds
the layers DeepSpeed's way; ``deepspeed.initialize(model=PipelineModule(...))`` returns the
``PipelineEngine`` (``engine.py``) whose ``train_batch``/``eval_batch`` run the strategy's schedule."""
from .....strategies.pipeline.module import LayerSpec, TiedLayerSpec
from .engine import PipelineEngine
from .module import PipelineModule

__all__ = ["LayerSpec", "PipelineEngine", "PipelineModule", "TiedLayerSpec"]
