"""Strategies: how model and optimizer are wrapped, partitioned and communicated.

Every strategy a preset name builds is importable from here (``README.md`` in this folder has the
table), so ``Trainer(strategy=ZeroStage3(...))`` needs no deeper import:

=======================  ====================================================================
``SingleDevice``         one process (``"single"``); the class is Lightning's ``SingleDeviceStrategy``
``DDP``                  replicated data parallel (``"ddp"``); the class is Lightning's ``DDPStrategy``
``ZeroStage1/2/3``       ZeRO stages 1-3 (``"zero1"``, ``"zero2"``, ``"zero3"``), built from a
                         ``ZeroSpec`` (``ZeroConfig``, ``BucketConfig``, ``Stage3Config``)
``Offload``              ZeRO 2/3 with the optimizer in host RAM or on NVMe (``"offload"``,
                         ``"offload_cpu"``, ``"offload_nvme"``; options: ``OffloadPolicy``)
``PipelineStrategy``     pipeline parallelism (``"pipeline"``; ``PipelineConfig``,
                         ``PipelineModule``, ``LayerSpec``)
``ModelParallel...``     ``ModelParallelStrategy``, Lightning's: the user's torch tensor
                         parallelism / FSDP2 on a (data, tensor) ``DeviceMesh`` (``model_parallel/``)
=======================  ====================================================================

``strategy_from_name(name, **options)`` builds a preset by name, as ``Trainer(strategy=name)``.

May import: ops, trainer.errors."""
from .base import Strategy
from .ddp import DDP, DDPConfig, DDPStrategy
from .environment import ProcessInfo
from .precision import Precision, precision_from_name
from .registry import available, register, strategy_from_name
from .single_device import SingleDevice, SingleDeviceStrategy
from .zero import BucketConfig, Stage3Config, ZeroConfig, ZeroSpec, ZeroStage1, ZeroStage2, ZeroStage3  # noqa: I001
from .offload import Offload, OffloadPolicy
from .pipeline import LayerSpec, PipelineConfig, PipelineModule, PipelineStrategy
from .model_parallel import ModelParallelStrategy

__all__ = ["Strategy", "DDP", "DDPConfig", "DDPStrategy", "SingleDevice", "SingleDeviceStrategy", "ZeroStage1",
           "ZeroStage2", "ZeroStage3", "ZeroSpec", "ZeroConfig", "BucketConfig", "Stage3Config", "Offload",
           "OffloadPolicy", "PipelineStrategy", "PipelineConfig", "PipelineModule", "LayerSpec", "ModelParallelStrategy",
           "ProcessInfo", "Precision", "precision_from_name", "available", "register", "strategy_from_name"]
