"""Parallelism beyond data and depth (issue 45): the device mesh a job's ranks form (``mesh.py``:
data x sequence, tensor to come) and Ulysses sequence parallelism (``ulysses.py``: all-to-alls that
turn sequence shards into head shards around any local attention, and back; ``hf.py``: the same
for a Hugging Face model through its attention-implementation hook).

Not wired into the Trainer yet: strategies/README.md ("Sequence parallelism in the Trainer: the plan") says how a
strategy will split each batch's sequence over the sequence group.

May import: nothing."""
from .hf import use_ulysses
from .mesh import AXES, ParallelMesh
from .ulysses import heads_to_sequence, repeat_kv_for, sequence_to_heads, ulysses_attention

__all__ = ["AXES", "ParallelMesh", "heads_to_sequence", "repeat_kv_for", "sequence_to_heads", "ulysses_attention",
           "use_ulysses"]
