"""``deepspeed.runtime.utils.PartitionedTensor`` on 2 gloo ranks: each rank keeps its run of the
flattened tensor (the longer run first when the count is odd), ``full()`` gathers the original back
bit for bit, and ``to_meta()`` / ``from_meta()`` rebuild it from the run alone. Found running
DeepSpeed's tests/unit renamed (issue 42): its runtime/utils/test_partition.py imports the class,
so that module did not import under zerotrain."""
from __future__ import annotations

import pytest
import torch

from harness import init_dist, run_ranks


def _rank(rows: int, cols: int) -> dict:
    import torch.distributed as dist

    from zerotrain.deepspeed.runtime.utils import PartitionedTensor

    rank, world = init_dist()
    full = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) * 0.5
    part = PartitionedTensor(full, group=dist.new_group(ranks=list(range(world))))
    rebuilt = PartitionedTensor.from_meta(part.to_meta(), part.local_data, part.group)
    return {"local": part.local_data.clone(), "size": list(part.local_size()), "full": part.full(),
            "meta_full": rebuilt.full(), "meta": part.to_meta()}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("rows, cols", [(4, 3), (5, 3)])
def test_each_rank_keeps_its_run_and_full_gathers_the_tensor(tmp_path, rows, cols):
    got = run_ranks("test_deepspeed_partitioned_tensor:_rank", 2, tmp_path, timeout=200, rows=rows, cols=cols)
    full = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) * 0.5
    first = (rows * cols + 1) // 2  # the longer run on rank 0
    for rank, (start, stop) in enumerate([(0, first), (first, rows * cols)]):
        assert torch.equal(got[rank]["local"], full.reshape(-1)[start:stop])
        assert got[rank]["size"] == [stop - start]
        assert torch.equal(got[rank]["full"], full)
        assert torch.equal(got[rank]["meta_full"], full)
        assert got[rank]["meta"].tolist() == [2, rows, cols, 2, rank, 0, first, rows * cols]
