"""ZeRO partition arithmetic, checked element by element against a brute-force model."""
import pytest

from zerotrain.strategies.zero.layout import (
    build_layout, flat_buckets, intersect, owner_runs, partition_chunks)

SIZES = [
    [5, 0, 7, 3, 1],  # uneven, with an empty parameter
    [1],
    [13 * 17, 17, 17 * 11, 11, 11, 11, 11 * 5, 5],
    [64, 64, 64],  # divides evenly for 2 and 4
    [],
]


def elements(numels):
    """(param index, element) for every element of the flat buffer, in order."""
    return [(i, k) for i, n in enumerate(numels) for k in range(n)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("numels", SIZES)
@pytest.mark.parametrize("alignment", [1, 4])
def test_layout_offsets_padding_and_partitions(numels, world, alignment):
    layout = build_layout(numels, world, alignment)
    total = sum(numels)
    assert layout.numel == total
    assert layout.padded_numel % (world * alignment) == 0
    assert 0 <= layout.padding < world * alignment
    assert layout.partition_numel * world == layout.padded_numel
    assert layout.partition_numel % alignment == 0
    offset = 0
    for i, span in enumerate(layout.spans):
        assert (span.index, span.offset, span.numel) == (i, offset, numels[i])
        offset += numels[i]
    ranges = [layout.partition_range(r) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == layout.padded_numel
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("numels", SIZES)
def test_pieces_match_brute_force(numels, world):
    layout = build_layout(numels, world)
    flat = elements(numels) + [None] * layout.padding
    p = layout.partition_numel
    for rank in range(world):
        expected = [e for e in flat[rank * p:(rank + 1) * p] if e is not None]
        got = []
        for pc in layout.pieces(rank):
            assert pc.rank == rank
            for k in range(pc.numel):
                # the piece's place in the partition holds the element it claims
                assert flat[rank * p + pc.partition_start + k] == (pc.index, pc.param_start + k)
                got.append((pc.index, pc.param_start + k))
        assert got == expected
    for i, n in enumerate(numels):  # each parameter is cut into pieces that cover it exactly once
        pieces = layout.pieces_of(i)
        assert sum(pc.numel for pc in pieces) == n
        assert [pc.param_start for pc in pieces] == [sum(q.numel for q in pieces[:j]) for j in range(len(pieces))]
        for pc in pieces:
            assert layout.owner(layout.spans[i].offset + pc.param_start) == pc.rank


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("numels", SIZES)
@pytest.mark.parametrize("capacity", [1, 6, 40, 10**6])
def test_flat_buckets_cover_parameters_last_first(numels, world, capacity):
    layout = build_layout(numels, world)
    buckets = flat_buckets(layout, capacity)
    seen = [i for b in buckets for i in b.indices]
    assert sorted(seen) == [i for i, n in enumerate(numels) if n]  # every non-empty param, once
    assert seen == sorted(seen, reverse=True)  # backward order: the last parameters first
    for b in buckets:
        spans = sorted((layout.spans[i] for i in b.indices), key=lambda s: s.offset)
        assert (b.lo, b.hi) == (spans[0].offset, spans[-1].end)
        assert all(a.end == c.offset for a, c in zip(spans, spans[1:]))  # contiguous
        assert b.numel <= capacity or len(b.indices) == 1
        runs = owner_runs(layout, b)  # the bucket cut at partition boundaries
        assert sum(r.numel for r in runs) == b.numel
        pos = 0
        for r in runs:
            assert r.offset == pos
            assert {layout.owner(b.lo + r.offset + k) for k in range(r.numel)} == {r.rank}
            pos += r.numel
    if len(buckets) > 1:  # greedy: a bucket is only closed when the next parameter does not fit
        for a, nxt in zip(buckets, buckets[1:]):
            assert a.numel + layout.spans[nxt.indices[0]].numel > capacity


def test_flat_buckets_example():
    layout = build_layout([4, 4, 4, 4], 2)
    assert [(b.lo, b.hi, b.indices) for b in flat_buckets(layout, 8)] == [(8, 16, (3, 2)), (0, 8, (1, 0))]
    assert [(b.lo, b.hi) for b in flat_buckets(layout, 7)] == [(12, 16), (8, 12), (4, 8), (0, 4)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("partition", [0, 1, 7, 100])
@pytest.mark.parametrize("bucket", [1, 5, 12, 1000])
def test_partition_chunks(partition, world, bucket):
    chunks = partition_chunks(partition, world, bucket)
    covered = [k for s, e in chunks for k in range(s, e)]
    assert covered == list(range(partition))
    step = max(1, bucket // world)
    assert all(0 < e - s <= step for s, e in chunks)
    if bucket >= world:
        assert all(world * (e - s) <= bucket for s, e in chunks)


def test_examples_and_errors():
    layout = build_layout([5, 0, 7, 3, 1], 3)  # 16 elements -> 18, partitions of 6
    assert (layout.padded_numel, layout.partition_numel, layout.padding) == (18, 6, 2)
    assert [(p.index, p.param_start, p.partition_start, p.numel) for p in layout.pieces(1)] == [
        (2, 1, 0, 6)]
    assert [(p.rank, p.numel) for p in layout.pieces_of(2)] == [(0, 1), (1, 6)]
    assert build_layout([], 4).padded_numel == 0
    assert build_layout([3], 2, alignment=8).padded_numel == 16
    assert intersect(0, 4, 4, 8) is None and intersect(0, 5, 4, 8) == (4, 5)
    with pytest.raises(ValueError, match="world_size=0"):
        build_layout([1], 0)
    with pytest.raises(ValueError, match="alignment=0"):
        build_layout([1], 2, alignment=0)
    with pytest.raises(ValueError, match=r"numels\[1\]=-1"):
        build_layout([1, -1], 2)
    with pytest.raises(ValueError, match="rank=3"):
        layout.partition_range(3)
    with pytest.raises(ValueError, match="reduce_bucket_size=0"):
        flat_buckets(layout, 0)
    with pytest.raises(ValueError, match="allgather_bucket_size=0"):
        partition_chunks(4, 2, 0)
