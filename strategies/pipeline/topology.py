"""Pure rank arithmetic for a grid of pipeline stages x data-parallel replicas.

Ranks are laid out stage-fastest: replica ``r`` is the contiguous block of ranks
``r * stages .. r * stages + stages - 1``, so neighbouring stages (which exchange activations on
every micro-batch) sit on neighbouring ranks, usually the same node, while the data-parallel
all-reduce (once per step) crosses the blocks. Global rank 0 is stage 0 of replica 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class PipelineGrid:
    world_size: int
    stages: int

    def __post_init__(self) -> None:
        if self.stages < 1:
            raise ValueError(f"pipeline: stages={self.stages!r} must be >= 1")
        if self.world_size < 1 or self.world_size % self.stages:
            raise ValueError(
                f"pipeline: world_size={self.world_size} is not a multiple of stages={self.stages}; "
                "the world is stages x data-parallel replicas, so launch a multiple of "
                f"{self.stages} processes or change stages")

    @property
    def replicas(self) -> int:
        return self.world_size // self.stages

    def stage_of(self, rank: int) -> int:
        return rank % self.stages

    def replica_of(self, rank: int) -> int:
        return rank // self.stages

    def rank_of(self, stage: int, replica: int) -> int:
        if not (0 <= stage < self.stages and 0 <= replica < self.replicas):
            raise IndexError(f"stage={stage}, replica={replica} outside {self}")
        return replica * self.stages + stage

    def stage_ranks(self, replica: int) -> list[int]:
        """The ranks of one pipeline (one replica), stage 0 first."""
        return [self.rank_of(s, replica) for s in range(self.stages)]

    def data_parallel_ranks(self, stage: int) -> list[int]:
        """The ranks holding the same stage in every replica (its gradient all-reduce group)."""
        return [self.rank_of(stage, r) for r in range(self.replicas)]

    def tie_ranks(self, owner_stages: Sequence[int], replica: int) -> list[int]:
        """The ranks in one replica that hold a copy of a tied weight."""
        return [self.rank_of(s, replica) for s in sorted(set(owner_stages))]

    def prev_rank(self, rank: int) -> int | None:
        s = self.stage_of(rank)
        return None if s == 0 else rank - 1

    def next_rank(self, rank: int) -> int | None:
        s = self.stage_of(rank)
        return None if s == self.stages - 1 else rank + 1

    def ring_prev_rank(self, rank: int) -> int:
        """The previous stage round the ring of one replica (interleaved 1F1B: stage 0's
        later chunks take their inputs from the last stage)."""
        s = self.stage_of(rank)
        return self.rank_of((s - 1) % self.stages, self.replica_of(rank))

    def ring_next_rank(self, rank: int) -> int:
        s = self.stage_of(rank)
        return self.rank_of((s + 1) % self.stages, self.replica_of(rank))
