"""ZeRO's collectives on gloo (``strategies/zero/comm/collectives.py``), which travel there as per-rank
broadcasts (all-gather) and one all-to-all plus a rank-order sum (reduce-scatter, even or with
uneven pieces): on 2 and 3 ranks, for the world and for a subgroup, they give what
``all_gather_into_tensor``, ``reduce_scatter_tensor`` and one ``reduce`` per owner define,
exactly."""
import pytest
import torch
import torch.distributed as dist

from harness import init_dist, run_ranks
from zerotrain.strategies import instrument
from zerotrain.strategies.zero.comm import collectives as comm


def _values(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(n, generator=g).to(dtype)


class _Sink:
    def __init__(self, events: list) -> None:
        self.events = events

    def collective(self, event) -> None:
        self.events.append(event)


def _collectives():
    rank, world = init_dist()
    out = {}
    groups = {"world": (None, list(range(world)))}
    if world == 3:
        groups["pair"] = (dist.new_group([1, 2]), [1, 2])  # group ranks 0, 1 are global 1, 2
    events = []
    sink = _Sink(events)
    instrument.add_sink(sink)
    try:
        for name, (group, members) in groups.items():
            if rank not in members:
                continue
            size, me = len(members), members.index(rank)
            for dtype in (torch.float32, torch.bfloat16):
                n = 5  # a piece per rank; odd, so no vectorised tail hides an off-by-one
                inp = _values(rank, size * n, dtype)
                got = torch.full((n,), float("nan"), dtype=dtype)
                scratch = torch.empty(comm.reduce_scatter_scratch(size * n, group) + n, dtype=dtype)
                h = comm.reduce_scatter_sum(got, inp, group, scratch=scratch)
                h.wait()
                # the same sum, in rank order, from every member's input
                want = sum(_values(g, size * n, dtype)[me * n:(me + 1) * n] for g in members)
                out[f"rs-{name}-{dtype}"] = (got, want)
                # the sum may land in the scratch's own first piece (zero3 passes it that way)
                inplace = torch.empty(size * n, dtype=dtype)
                comm.reduce_scatter_sum(inplace[:n], inp, group, scratch=inplace).wait()
                out[f"rs-inplace-{name}-{dtype}"] = (inplace[:n], want)

                # uneven pieces (ZeRO-1/2's buckets), one rank owning none or all of the buffer
                for sizes in ([3, 0, 9][:size - 1] + [4], [0] * (size - 1) + [11], [7] + [0] * (size - 1)):
                    total = sum(sizes)
                    buf = _values(rank, total, dtype)
                    lo, k = sum(sizes[:me]), sizes[me]
                    want = sum(_values(g, total, dtype)[lo:lo + k] for g in members)
                    rest = buf.clone()
                    comm.reduce_to_owners(buf, sizes, group).wait()
                    out[f"owners-{sizes}-{name}-{dtype}"] = (buf[lo:lo + k], want)
                    # outside my piece the buffer is left as it was
                    out[f"owners-rest-{sizes}-{name}-{dtype}"] = (torch.cat([buf[:lo], buf[lo + k:]]),
                                                                  torch.cat([rest[:lo], rest[lo + k:]]))
                    # the sum may land elsewhere, its scratch beginning there (2 ranks, zero2)
                    land = torch.full((max(k, comm.owners_scratch(sizes, group)),), float("nan"), dtype=dtype)
                    comm.reduce_to_owners(rest, sizes, group, out=land[:k], scratch=land).wait()
                    out[f"owners-out-{sizes}-{name}-{dtype}"] = (land[:k], want)

                mine = _values(rank, n, dtype)
                full = torch.full((size * n,), float("nan"), dtype=dtype)
                comm.all_gather_into(full, mine, group).wait()
                out[f"ag-{name}-{dtype}"] = (full, torch.cat([_values(g, n, dtype) for g in members]))
                # the input may already be this rank's place in the output
                full2 = torch.cat([_values(g, n, dtype) if g == rank else torch.zeros(n, dtype=dtype)
                                   for g in members])
                comm.all_gather_into(full2, full2[me * n:(me + 1) * n], group).wait()
                out[f"ag-inplace-{name}-{dtype}"] = (full2, out[f"ag-{name}-{dtype}"][1])
    finally:
        instrument.remove_sink(sink)
    # every launch is reported once, under its own name, and completes (its future fired)
    out["events"] = sorted({(e.op, e.nbytes, e.t_done is not None) for e in events})
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_collectives_match_their_definitions(world, tmp_path):
    results = run_ranks("test_comm:_collectives", world, tmp_path, timeout=90)
    for rank, res in enumerate(results):
        events = res.pop("events")
        assert res, f"rank {rank} ran no case"
        for case, (got, want) in res.items():
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"rank {rank} {case}")
        # reported under their own names, with the collective's message size (fp32, world)
        assert ("reduce_scatter", 4 * world * 5, True) in events and ("all_gather", 4 * world * 5, True) in events
        assert ("reduce", 4 * 11, True) in events  # uneven: the whole buffer's size
        assert all(done for _, _, done in events), events
