"""ZeRO stage 3: the parameters themselves partitioned, gathered around each unit's use.

``strategy`` (``ZeroStage3``: the stage's pieces of the step, built from the ones below),
``checkpoint`` (its shards at a save and their load), ``unit_plan`` (which parameters are gathered
together), ``unit`` (one unit's shards and its SHARDED/GATHERING/UNSHARDED state), ``runtime``
(what each forward/backward event does to the units), ``touch`` and ``materialize`` (partitioned
construction: the model built a unit at a time, never whole), ``experts`` (expert-parallel units
over their expert-data-parallel group, issue 46).

Only ``zero.hooks`` (the stage-3 hooks) and ``zero/__init__`` import this package, plus
``offload.param_swap`` (a unit's shards on NVMe). Nothing is imported here, so ``unit`` or
``touch`` may be imported without the strategy.
May import: strategies.base, strategies.checkpoint, strategies.compile, strategies.environment, strategies.memory, strategies.moe, strategies.optimizers, strategies.parallel, strategies.partitioned, strategies.step_wrapper, strategies.zero.comm, strategies.zero.config, strategies.zero.hooks, strategies.zero.layout, strategies.zero.sharded_optimizer, strategies.zero.shards, strategies.zero.strategy.
"""
