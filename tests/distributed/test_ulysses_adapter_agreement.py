"""``UlyssesSPDataLoaderAdapter`` (the ALST face) when the ranks of a sequence group disagree, on 2
real gloo processes: every rank must reach the same outcome at the same batch, with no rank left
waiting in a collective its peer never joins.

* rank 1's loader holds one batch fewer: both ranks end the epoch at the same micro-batch;
* rank 1's second batch lacks ``position_ids``: both ranks raise, naming sequence-parallel rank 1;
* rank 1's batch carries an extra key: both ranks raise, naming the keys;
* a key of another dtype, or a tensor on one rank and not on the other: both raise, naming it.

Without the adapter's header exchange, rank 0 waits in an all-gather that rank 1 left (the spawn
times out or gloo reports the closed peer). No deepspeed or transformers needed.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from harness import init_dist, run_ranks

pytestmark = pytest.mark.timeout(120)

S = 4


def _batch(i: int, *, position_ids: bool = True, extra: bool = False) -> dict:
    x = torch.arange(S).add(10 * i).unsqueeze(0)
    batch = {"input_ids": x, "labels": x.clone()}
    if position_ids:
        batch["position_ids"] = torch.arange(S).unsqueeze(0)
    if extra:
        batch["attention_mask"] = torch.ones_like(x)
    return batch


def _outcome(adapter) -> tuple[int, str]:
    """(micro-batches drawn, how the iteration ended)."""
    n = 0
    try:
        for _ in adapter:
            n += 1
    except ValueError as e:
        return n, f"ValueError: {e}"
    return n, "end"


def _ranks() -> dict:
    from zerotrain.deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    rank, world = init_dist()
    group = dist.new_group(list(range(world)))
    cases = {
        "shorter": [_batch(i) for i in range(3 - rank)],
        "no_position_ids": [_batch(0), _batch(1, position_ids=rank != 1)],
        "extra_key": [_batch(0, extra=rank == 1)],
        "dtype": [{**_batch(0), "labels": _batch(0)["labels"].to(torch.int32 if rank else torch.int64)}],
        "kind": [{**_batch(0), "meta": torch.zeros(1, S) if rank else "text"}],
    }
    return {name: _outcome(UlyssesSPDataLoaderAdapter(batches, rank, group, world, torch.device("cpu")))
            for name, batches in cases.items()}


def test_ranks_that_disagree_end_or_fail_together(tmp_path):
    got = run_ranks("test_ulysses_adapter_agreement:_ranks", 2, tmp_path, timeout=100)
    assert got[0] == got[1]
    out = got[0]
    assert out["shorter"] == (4, "end")  # two batches on both ranks, two shards of each: 4 micro-batches
    n, err = out["no_position_ids"]
    assert n == 2 and err.startswith("ValueError") and "rank 1" in err and "position_ids" in err
    n, err = out["extra_key"]
    assert n == 0 and "attention_mask" in err and "keys" in err
    n, err = out["dtype"]
    assert n == 0 and "batch['labels'] differs" in err and "torch.int32" in err and "torch.int64" in err
    n, err = out["kind"]
    assert n == 0 and "batch['meta'] differs" in err and "not a tensor" in err
