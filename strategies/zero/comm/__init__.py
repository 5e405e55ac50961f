"""ZeRO's communication: every collective a ZeRO stage launches, and what stands between a
launch and its wait.

``collectives`` (the collectives, returning handles; gloo's forms), ``inflight`` (every collective
in flight, typed by what it is for, and the one place that waits on a handle), ``quantized``
(ZeRO++: the int8 gather and the all-to-all reduction, launched where the exact collective would
be), ``grad_norm`` (the clip norm as torch's: per-parameter norms, boundary parameters assembled,
one all-reduce) and ``reduction`` (stage 1/2's bucketed gradient reduction during backward).

Not the stage strategies (``zero.strategy``, ``zero.stage1/2``, ``zero.stage3``), which import
this package. Nothing is imported here, so a module of this package may be imported without the others.
May import: ops, strategies.instrument, strategies.progress, strategies.zero.layout, strategies.zero.flat_buffer, strategies.zero.hooks.
"""
