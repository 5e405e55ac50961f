"""zero3's ``keep_gathered_storage`` on real gloo processes: the gathered buffers keep their memory
between steps (the same allocation, full size, while sharded), and training is exactly what the
default gives: the plain single-process PyTorch reference of ``test_zero3``."""
from __future__ import annotations

import os

import pytest

from harness import run_ranks_once
from test_zero3 import LM, fit, lm_reference
from toy import assert_params_close
from zerotrain import Callback
from zerotrain.strategies.zero import ZeroStage3
from zerotrain.strategies.zero.unit import ShardState

pytestmark = pytest.mark.timeout(300)


class Storage(Callback):
    """At the start of every micro-batch (every unit but the root sharded): per sharded unit,
    its gathered buffer's storage address and size."""

    def __init__(self) -> None:
        self.seen: list[dict[int, tuple[int, int]]] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.seen.append({u.index: (u.full.untyped_storage().data_ptr(), u.full.untyped_storage().nbytes())
                          for u in trainer.strategy.units if u.state is ShardState.SHARDED})


def _worker() -> dict:
    out = {}
    for keep in (False, True):
        seen = Storage()
        # max_reuse_distance=0: every block is freed after its forward and gathered again for its
        # backward, so kept storage is written twice per step and autograd's saved views of it
        # must read the second gather
        trainer = fit(LM(), ZeroStage3(prefetch_bucket_size=3200, max_reuse_distance=0,
                                       keep_gathered_storage=keep), callbacks=[seen])
        sizes = {u.index: u.full.numel() * u.full.element_size() for u in trainer.strategy.units}
        out[keep] = {"params": trainer.full_state_dict(), "seen": seen.seen, "sizes": sizes}
    return out


_SPAWNED: dict[int, object] = {}


@pytest.mark.parametrize("world", [2, 3])
def test_kept_storage_is_one_allocation_and_trains_exactly(world, tmp_path_factory):
    ranks = run_ranks_once(_SPAWNED, world, "test_zero3_storage:_worker", world, tmp_path_factory, timeout=240)
    ref = lm_reference(world, accum=2)
    for keep in (False, True):
        assert_params_close(ranks[0][keep]["params"], ref)
    for r in ranks:
        kept, freed = r[True], r[False]
        assert len(kept["seen"]) == 40 and all(kept["seen"])  # 20 steps x 2 micro-batches, blocks sharded
        for index in kept["seen"][0]:
            ptrs = {seen[index][0] for seen in kept["seen"]}
            assert len(ptrs) == 1, f"unit {index}: gathered into {len(ptrs)} allocations, not one"
            assert all(seen[index][1] == kept["sizes"][index] for seen in kept["seen"])
        # the default returns the memory: nothing held while sharded
        assert all(nbytes == 0 for seen in freed["seen"] for _, nbytes in seen.values())
