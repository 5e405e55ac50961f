"""Pure rank arithmetic for a grid of pipeline stages x data-parallel replicas, each stage
optionally a tensor-parallel group of ``tensor`` ranks.

Ranks are laid out stage-fastest: replica ``r`` is the contiguous block of ranks
``r * stages .. r * stages + stages - 1``, so neighbouring stages (which exchange activations on
every micro-batch) sit on neighbouring ranks, usually the same node, while the data-parallel
all-reduce (once per step) crosses the blocks. Global rank 0 is stage 0 of replica 0.

With a tensor axis (``tensor`` > 1) it is innermost, as Megatron orders it: a stage of a replica
is the ``tensor`` consecutive ranks ``(replica * stages + stage) * tensor + t`` (their collectives
run every layer), and every link between stages, every data-parallel group and every tie group
joins ranks of one tensor index ``t``: tensor rank ``t`` of a stage sends to tensor rank ``t`` of
the next, and reduces with tensor rank ``t`` of the other replicas.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class PipelineGrid:
    world_size: int
    stages: int
    #: ranks per stage (its tensor-parallel group); 1: none
    tensor: int = 1

    def __post_init__(self) -> None:
        if self.stages < 1:
            raise ValueError(f"pipeline: stages={self.stages!r} must be >= 1")
        if self.tensor < 1:
            raise ValueError(f"pipeline: tensor_parallel={self.tensor!r} must be >= 1")
        per_replica = self.stages * self.tensor
        if self.world_size < 1 or self.world_size % per_replica:
            across = f"stages={self.stages}" + (f" x tensor_parallel={self.tensor}" if self.tensor > 1 else "")
            raise ValueError(
                f"pipeline: world_size={self.world_size} is not a multiple of {across}; "
                "the world is stages x data-parallel replicas" + (" x tensor ranks" if self.tensor > 1 else "")
                + f", so launch a multiple of {per_replica} processes or change stages")

    @property
    def replicas(self) -> int:
        return self.world_size // (self.stages * self.tensor)

    def stage_of(self, rank: int) -> int:
        return rank // self.tensor % self.stages

    def replica_of(self, rank: int) -> int:
        return rank // (self.stages * self.tensor)

    def tensor_of(self, rank: int) -> int:
        """The rank's index in its stage's tensor group."""
        return rank % self.tensor

    def rank_of(self, stage: int, replica: int, tensor: int = 0) -> int:
        if not (0 <= stage < self.stages and 0 <= replica < self.replicas and 0 <= tensor < self.tensor):
            raise IndexError(f"stage={stage}, replica={replica}, tensor={tensor} outside {self}")
        return (replica * self.stages + stage) * self.tensor + tensor

    def stage_ranks(self, replica: int, tensor: int = 0) -> list[int]:
        """The ranks of one pipeline (one replica, one tensor index), stage 0 first."""
        return [self.rank_of(s, replica, tensor) for s in range(self.stages)]

    def data_parallel_ranks(self, stage: int, tensor: int = 0) -> list[int]:
        """The ranks holding the same stage (and tensor shard) in every replica (its gradient
        all-reduce group)."""
        return [self.rank_of(stage, r, tensor) for r in range(self.replicas)]

    def tensor_ranks(self, stage: int, replica: int) -> list[int]:
        """The ranks of one stage of one replica (its tensor-parallel group), consecutive."""
        return [self.rank_of(stage, replica, t) for t in range(self.tensor)]

    def tie_ranks(self, owner_stages: Sequence[int], replica: int, tensor: int = 0) -> list[int]:
        """The ranks in one replica (of one tensor index) that hold a copy of a tied weight."""
        return [self.rank_of(s, replica, tensor) for s in sorted(set(owner_stages))]

    def prev_rank(self, rank: int) -> int | None:
        s = self.stage_of(rank)
        return None if s == 0 else rank - self.tensor

    def next_rank(self, rank: int) -> int | None:
        s = self.stage_of(rank)
        return None if s == self.stages - 1 else rank + self.tensor

    def ring_prev_rank(self, rank: int) -> int:
        """The previous stage round the ring of one replica (interleaved 1F1B: stage 0's
        later chunks take their inputs from the last stage)."""
        s = self.stage_of(rank)
        return self.rank_of((s - 1) % self.stages, self.replica_of(rank), self.tensor_of(rank))

    def ring_next_rank(self, rank: int) -> int:
        s = self.stage_of(rank)
        return self.rank_of((s + 1) % self.stages, self.replica_of(rank), self.tensor_of(rank))
