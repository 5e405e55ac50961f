"""Parallelism beyond data and depth (issue 45): the device mesh a job's ranks form (``mesh.py``:
data x sequence, tensor to come) and Ulysses sequence parallelism (``ulysses.py``: all-to-alls that
turn sequence shards into head shards around any local attention, and back; ``hf.py``: the same
for a Hugging Face model through its attention-implementation hook).

In the Trainer: ``Strategy(sequence_parallel=n)`` builds the mesh (``environment.Ranks``), and
``sequence.py`` cuts each batch along the sequence and gives the loss over all tokens
(strategies/README.md, "Sequence parallelism in the Trainer").

May import: nothing."""
from .hf import use_ulysses
from .mesh import AXES, ParallelMesh
from .sequence import sequence_mean, shard_sequence
from .ulysses import heads_to_sequence, repeat_kv_for, sequence_to_heads, ulysses_attention

__all__ = ["AXES", "ParallelMesh", "heads_to_sequence", "repeat_kv_for", "sequence_mean", "sequence_to_heads",
           "shard_sequence", "ulysses_attention", "use_ulysses"]
