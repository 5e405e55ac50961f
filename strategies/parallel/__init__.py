"""Parallelism beyond data and depth (issue 45): the device mesh a job's ranks form (``mesh.py``:
data x sequence x tensor) and Ulysses sequence parallelism (``ulysses.py``: all-to-alls that
turn sequence shards into head shards around any local attention, and back; ``hf.py``: the same
for a Hugging Face model through its attention-implementation hook), and tensor parallelism on plain
local parameters (``tensor.py``: the layers, their collectives and the vocabulary-parallel loss;
``tensor_plan.py``: plans in Hugging Face's and torch's vocabulary applied to a model;
``tensor_sequence.py``: the sequence-parallel variant's norms and dropouts, and each tensor rank's
random numbers inside the tensor-parallel regions;
``tensor_checkpoint.py``: tensor-parallel parameters saved whole in the reshardable checkpoint format
and loaded cut, for any strategy on any mesh).

In the Trainer: ``Strategy(sequence_parallel=n)`` builds the mesh (``environment.Ranks``), and
``sequence.py`` cuts each batch along the sequence and gives the loss over all tokens
(strategies/README.md, "Sequence parallelism in the Trainer").

May import: strategies.checkpoint, strategies.instrument."""
from .hf import use_ulysses
from .mesh import AXES, ParallelMesh
from .sequence import sequence_mean, shard_sequence
from .tensor import (ParallelLinear, TensorShard, VocabParallelEmbedding, full_tensor, tensor_parallel_norm,
                     vocab_parallel_cross_entropy)
from .tensor_plan import parallelize_tensor, plan_of
from .tensor_sequence import SequenceParallelDropout, SequenceParallelNorm, TensorRNG
from .ulysses import heads_to_sequence, repeat_kv_for, sequence_to_heads, ulysses_attention

__all__ = ["AXES", "ParallelLinear", "ParallelMesh", "SequenceParallelDropout", "SequenceParallelNorm", "TensorRNG",
           "TensorShard", "VocabParallelEmbedding", "full_tensor",
           "heads_to_sequence", "parallelize_tensor", "plan_of", "repeat_kv_for", "sequence_mean", "sequence_to_heads",
           "shard_sequence", "tensor_parallel_norm", "ulysses_attention", "use_ulysses", "vocab_parallel_cross_entropy"]
